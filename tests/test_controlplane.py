"""The foundation: a real API server with the behaviour the protocol relies on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import yaml

from conftest import NEVER_SCHEDULED, Cluster, make_task, wait_for
from tasklease.api import errors
from tasklease.kube import LEASES, PODS, Kube, Resource
from tasklease_dev import binaries
from tasklease_dev.cluster import LocalCluster, process_alive

CRDS = Resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
CONFIGMAPS = Resource("", "v1", "configmaps")
SERVICEACCOUNTS = Resource("", "v1", "serviceaccounts")
ROLES = Resource("rbac.authorization.k8s.io", "v1", "roles")
ROLEBINDINGS = Resource("rbac.authorization.k8s.io", "v1", "rolebindings")


def _lease(name: str, holder: str) -> dict[str, Any]:
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": name},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": 10}}


def test_control_plane_reports_the_pinned_version(cluster: Cluster) -> None:
    version = cluster.kube().request("GET", "/version")
    assert version["gitVersion"].startswith("v1.")
    if cluster.version is not None:
        assert version["gitVersion"] == binaries.KUBERNETES_VERSION
    assert cluster.kube().request("GET", "/apis/coordination.k8s.io/v1")["groupVersion"] == "coordination.k8s.io/v1"


def test_task_crd_is_installed_and_established(cluster: Cluster) -> None:
    crd = cluster.kube().request("GET", CRDS.path(None, "tasks.tasklease.dev"))
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions["Established"] == "True"
    assert cluster.kube().request("GET", "/apis/tasklease.dev/v1alpha1")["groupVersion"] == "tasklease.dev/v1alpha1"


def test_ten_concurrent_creates_of_one_lease_get_one_201_and_nine_409s(kube: Kube) -> None:
    barrier = threading.Barrier(10)

    def create(i: int) -> str:
        barrier.wait()
        try:
            kube.create(LEASES, _lease("contended", f"client-{i}"))
            return "created"
        except errors.Conflict:
            return "conflict"

    with ThreadPoolExecutor(10) as pool:
        outcomes = list(pool.map(create, range(10)))
    assert outcomes.count("created") == 1
    assert outcomes.count("conflict") == 9


def test_put_with_a_stale_resource_version_gets_409(kube: Kube) -> None:
    first = kube.create(LEASES, _lease("stale", "a"))
    first["spec"]["holderIdentity"] = "b"
    kube.replace(LEASES, first)  # moves the resourceVersion on
    first["spec"]["holderIdentity"] = "c"  # still carries the old resourceVersion
    with pytest.raises(errors.Conflict):
        kube.replace(LEASES, first)
    assert kube.get(LEASES, "stale")["spec"]["holderIdentity"] == "b"


def test_deleting_an_owner_removes_its_owned_lease(kube: Kube) -> None:
    owner = kube.create(CONFIGMAPS, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owner"}})
    body = _lease("owned", "a")
    body["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner",
                                            "uid": owner["metadata"]["uid"]}]
    kube.create(LEASES, body)
    kube.delete(CONFIGMAPS, "owner")
    wait_for(lambda: kube.get_or_none(LEASES, "owned") is None, timeout=60,
             message="the garbage collector to delete the owned Lease")


def test_pod_bound_token_authenticates_and_rbac_refuses_what_is_not_granted(
        cluster: Cluster, kube: Kube, namespace: str, tmp_path: Any) -> None:
    kube.create(SERVICEACCOUNTS, {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "agent"}})
    kube.create(ROLES, {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "leases"},
                        "rules": [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                                   "verbs": ["get", "list", "create"]}]})
    kube.create(ROLEBINDINGS, {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "agent-leases"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "leases"},
        "subjects": [{"kind": "ServiceAccount", "name": "agent", "namespace": namespace}]})
    pod = kube.create(PODS, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "agent-0"},
                             "spec": {"serviceAccountName": "agent", "automountServiceAccountToken": False,
                                      "nodeSelector": NEVER_SCHEDULED,
                                      "containers": [{"name": "agent", "image": "agent:dev"}]}})
    token = kube.request("POST", SERVICEACCOUNTS.path(namespace, "agent", "token"), body={
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
        "spec": {"expirationSeconds": 3600, "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": "agent-0",
                                                              "uid": pod["metadata"]["uid"]}}})["status"]["token"]
    config = yaml.safe_load(cluster.kubeconfig.read_text())
    config["users"] = [{"name": "agent", "user": {"token": token}}]
    config["contexts"][0]["context"].update(user="agent", namespace=namespace)
    path = tmp_path / "agent.kubeconfig"
    path.write_text(yaml.safe_dump(config))
    agent = Kube.connect(kubeconfig=str(path))

    review = agent.request("POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews",
                           body={"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
    user = review["status"]["userInfo"]
    assert user["username"] == f"system:serviceaccount:{namespace}:agent"
    assert user["extra"]["authentication.kubernetes.io/pod-name"] == ["agent-0"]

    agent.create(LEASES, _lease("granted", "agent-0"))  # granted: create
    with pytest.raises(errors.Forbidden):
        agent.delete(LEASES, "granted")  # not granted: delete
    with pytest.raises(errors.Forbidden):
        agent.list(CONFIGMAPS)  # not granted at all
    assert json.dumps(kube.get(LEASES, "granted")["spec"]["holderIdentity"]) == '"agent-0"'


def test_cluster_up_is_idempotent_and_down_leaves_no_process(cluster: Cluster, tmp_path: Any) -> None:
    if cluster.version is None:
        pytest.skip("starts a second local control plane")
    local = LocalCluster(tmp_path / "second")
    first = local.up()
    try:
        assert local.up().pids == first.pids  # a second `up` finds the running one
        assert all(process_alive(pid) for pid in first.pids.values())
    finally:
        local.down()
    assert not any(process_alive(pid) for pid in first.pids.values())
    assert not (tmp_path / "second" / "etcd-data").exists()


def test_one_component_restarts_and_down_spares_a_process_that_is_not_its_own(
        cluster: Cluster, tmp_path: Any) -> None:
    if cluster.version is None:
        pytest.skip("starts a second local control plane")
    local = LocalCluster(tmp_path / "third")
    first = local.up()
    stranger = subprocess.Popen(["sleep", "300"])
    real_etcd = first.pids["etcd"]
    try:
        old = first.pids["kube-apiserver"]
        restarted = local.restart("kube-apiserver")  # kill -9 and start again, same port and data
        assert restarted.pids["kube-apiserver"] != old and not process_alive(old)
        assert local.running() is not None  # every component up, the API server answering
        assert not local.owns(stranger.pid)
        # As if the pid in the state file had been reused by another program.
        state_file = tmp_path / "third" / "cluster.json"
        state = json.loads(state_file.read_text())
        state["pids"]["etcd"] = stranger.pid
        state_file.write_text(json.dumps(state))
        local.down()
        assert stranger.poll() is None  # not ours: left alone
    finally:
        stranger.kill()
        stranger.wait()
        if process_alive(real_etcd):
            os.kill(real_etcd, signal.SIGKILL)


# What `make bench` and `make chaos` do with their control plane: started, stopped in a
# `finally`, SIGTERM unwinding the main thread to it (`stop_on_sigterm`).
_STOPPED_ON_SIGTERM = """
import sys, time
from pathlib import Path
from tasklease_dev.cluster import LocalCluster, stop_on_sigterm
local = LocalCluster(Path(sys.argv[1]))
stop_on_sigterm()
try:
    print(" ".join(map(str, local.up().pids.values())), flush=True)
    time.sleep(300)
finally:
    local.down()
"""


def test_a_run_stopped_by_sigterm_stops_its_control_plane(cluster: Cluster, tmp_path: Any) -> None:
    if cluster.version is None:
        pytest.skip("starts a second local control plane")
    run = subprocess.Popen([sys.executable, "-c", _STOPPED_ON_SIGTERM, str(tmp_path / "run")],
                           stdout=subprocess.PIPE, text=True)
    assert run.stdout is not None
    pids = [int(pid) for pid in run.stdout.readline().split()]
    try:
        assert len(pids) == 3 and all(process_alive(pid) for pid in pids)
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=60) == 128 + signal.SIGTERM
        assert not any(process_alive(pid) for pid in pids)
        assert not (tmp_path / "run" / "etcd-data").exists()
    finally:
        run.kill()
        run.wait()
        for pid in pids:
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)

def test_kubectl_finds_tasklease_as_a_plugin(cluster: Cluster, namespace: str) -> None:
    import os
    import sys

    make_task(cluster.kube(namespace), "via-kubectl", queue="plugin")
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
           "KUBECONFIG": str(cluster.kubeconfig)}
    out = subprocess.run([str(binaries.ensure_kubectl()), "tasklease", "list", "-n", namespace],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[:7] == ["NAME", "QUEUE", "PHASE", "HOLDER", "ATTEMPT", "AGE", "via-kubectl"]

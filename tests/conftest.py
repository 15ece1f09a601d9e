"""Fixtures: one real control plane for the whole session, a fresh namespace per test.

With TASKLEASE_KUBECONFIG=/path the suite runs against that cluster (kind, or any other)
and starts nothing; tests that read the local API server's audit log are skipped there.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.error
import urllib.request
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tasklease.api import errors
from tasklease.kube import LEASES, NAMESPACES, PODS, TASKQUEUES, TASKS, Kube, Resource
from tasklease.protocol import labels, record
from tasklease_dev import binaries
from tasklease_dev.cluster import LocalCluster, audit_files, free_port, namespaced_kubeconfig
from tasklease_dev.crds import apply_crds

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Cluster:
    kubeconfig: Path
    audit_log: Path | None  # None on an external cluster
    version: str | None  # the pinned version when we started it
    etcd_port: int | None = None  # None on an external cluster

    def kube(self, namespace: str = "default") -> Kube:
        return Kube.connect(kubeconfig=str(self.kubeconfig), namespace=namespace, pool_size=64)

    def namespaced_kubeconfig(self, namespace: str, directory: Path) -> Path:
        return namespaced_kubeconfig(self.kubeconfig, namespace, directory / f"admin-{namespace}.kubeconfig")

    def kubectl(self, *args: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(binaries.ensure_kubectl()), f"--kubeconfig={self.kubeconfig}", *args],
                              capture_output=True, text=True, check=check, input=input)


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    external = os.environ.get("TASKLEASE_KUBECONFIG")
    if external:
        found = Cluster(kubeconfig=Path(external), audit_log=None, version=None)
        apply_crds(kubeconfig=found.kubeconfig, folder=ROOT / "crds")
        yield found
        return
    local = LocalCluster(ROOT / ".cache" / "test-cluster")
    state = local.up()
    try:
        apply_crds(kubeconfig=Path(state.kubeconfig), folder=ROOT / "crds")
        started = Cluster(kubeconfig=Path(state.kubeconfig), audit_log=Path(state.audit_log), version=state.version,
                          etcd_port=state.etcd_port)
        wait_for(lambda: _serving_tasks(started.kube()), timeout=60, message="the Task CRD served (no 429)")
        yield started
    finally:
        local.down()


def _serving_tasks(kube: Kube) -> bool:
    try:
        kube.list(TASKS, limit=1)
        return True
    except (errors.ServerError, errors.CRDMissing, errors.Unreachable):
        return False  # a CRD just established answers 429 "storage is (re)initializing" for a moment


@pytest.fixture
def audit_log(cluster: Cluster) -> Path:
    if cluster.audit_log is None:
        pytest.skip("needs the local control plane's audit log")
    return cluster.audit_log


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    kube = cluster.kube()
    kube.create(NAMESPACES, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    yield name
    try:
        kube.delete(NAMESPACES, name)
    except errors.NotFound:
        pass


@pytest.fixture
def kube(cluster: Cluster, namespace: str) -> Kube:
    return cluster.kube(namespace)


def wait_for(condition: Callable[[], Any], *, timeout: float = 30.0, interval: float = 0.1,
             message: str = "condition") -> Any:
    """Poll with a deadline: for state the test cannot watch cheaply."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {message}")
        time.sleep(interval)


def refusal(write: Callable[[], Any]) -> str:
    """Why the API server refused `write`; "" when it was accepted."""
    try:
        write()
    except errors.TaskleaseError as exc:
        return str(exc)
    return ""


def make_task(kube: Kube, name: str, *, queue: str = "q", **spec: Any) -> dict[str, Any]:
    """Task `name`, labelled as the SDK and the CLI label what they create (`labels.labelled`)."""
    body = {"apiVersion": "tasklease.dev/v1alpha1", "kind": "Task", "metadata": {"name": name},
            "spec": {"queue": queue, **spec}}
    return kube.create(TASKS, labels.labelled(body))


def make_queue(kube: Kube, name: str, **spec: Any) -> dict[str, Any]:
    """A TaskQueue: its controls (`paused`, `maxRunning`, `claimsPerSecond`)."""
    return kube.create(TASKQUEUES, {"apiVersion": "tasklease.dev/v1alpha1", "kind": "TaskQueue",
                                    "metadata": {"name": name}, "spec": spec})


def undone(kube: Kube, name: str) -> bool:
    """The last claim of task `name` was undone by the operator (a queue's control broken)."""
    rec = record.decode(kube.get(LEASES, name))
    return not rec.holder and bool(rec.history) and rec.history[-1].outcome == "Undone"


# -- identities: service accounts with the chart's RBAC ------------------------------------

RELEASE = "tasklease-test"
SERVICEACCOUNTS = Resource("", "v1", "serviceaccounts")
CLUSTERROLEBINDINGS = Resource("rbac.authorization.k8s.io", "v1", "clusterrolebindings", namespaced=False)


@pytest.fixture(scope="session")
def chart_roles(cluster: Cluster) -> dict[str, str]:
    """Render the Helm chart with the real helm and apply its cluster-wide parts (the
    ClusterRoles and the agents' admission policy): the suite runs the operator and the
    agents with exactly the permissions and rules the chart installs."""
    rendered = subprocess.run([str(binaries.ensure_helm()), "template", RELEASE, str(ROOT / "helm" / "tasklease"),
                               "--kube-version", binaries.KUBERNETES_VERSION],  # offline helm assumes an old one
                              check=True, capture_output=True, text=True).stdout
    kinds = ("ClusterRole", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
    wanted = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] in kinds]
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(wanted))
    return {"operator": f"{RELEASE}-operator", "agent": f"{RELEASE}-agent"}


def service_account_kubeconfig(cluster: Cluster, namespace: str, name: str, cluster_role: str,
                               directory: Path, *, pod: dict[str, Any] | None = None) -> Path:
    """A kubeconfig holding a TokenRequest token of a new ServiceAccount bound to `cluster_role`
    (bound to `pod` when given, as a projected token in that pod would be)."""
    kube = cluster.kube(namespace)
    if kube.get_or_none(SERVICEACCOUNTS, name) is None:
        kube.create(SERVICEACCOUNTS, {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}})
    binding = f"{namespace}-{name}"
    if kube.get_or_none(CLUSTERROLEBINDINGS, binding) is None:
        kube.create(CLUSTERROLEBINDINGS, {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": binding},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_role},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]})
    spec: dict[str, Any] = {"expirationSeconds": 7200}
    if pod is not None:
        spec["boundObjectRef"] = {"apiVersion": "v1", "kind": "Pod", "name": pod["metadata"]["name"],
                                  "uid": pod["metadata"]["uid"]}
    token = kube.request("POST", SERVICEACCOUNTS.path(namespace, name, "token"), body={
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec})["status"]["token"]
    config = yaml.safe_load(cluster.kubeconfig.read_text())
    config["users"] = [{"name": name, "user": {"token": token}}]
    config["contexts"][0]["context"].update(user=name, namespace=namespace)
    path = directory / f"{name}-{uuid.uuid4().hex[:6]}.kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return path


AGENT_SA = "tasklease-agent"
# For Pod objects a test needs but never runs: no node has this label, so on a cluster with
# kubelets (kind) the pod stays Pending and is deleted at once, as on the bare control plane.
NEVER_SCHEDULED = {"tasklease.dev/test-pod": "never-scheduled"}


def agent_pod_kubeconfig(cluster: Cluster, namespace: str, pod_name: str, role: str, directory: Path) -> Path:
    """A Pod object of the chart's agent ServiceAccount and a kubeconfig with a token bound
    to it, as that pod would mount: the agent's real rights and admission rules."""
    admin = cluster.kube(namespace)
    service_account_kubeconfig(cluster, namespace, AGENT_SA, role, directory)  # the ServiceAccount first
    pod = admin.create(PODS, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod_name},
                              "spec": {"serviceAccountName": AGENT_SA, "automountServiceAccountToken": False,
                                       "nodeSelector": NEVER_SCHEDULED,
                                       "containers": [{"name": "agent", "image": "agent:dev"}]}})
    return service_account_kubeconfig(cluster, namespace, AGENT_SA, role, directory, pod=pod)


# -- processes -------------------------------------------------------------------------------


class Process:
    """A tasklease process (operator or agent) with its output in a file."""

    def __init__(self, argv: list[str], *, log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        self._out = open(log, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **(env or {})})

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self) -> int:
        self.kill(signal.SIGTERM)
        try:
            return self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.kill(signal.SIGKILL)
            return self.proc.wait(5)
        finally:
            self._out.close()

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)


def tasklease_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "tasklease.cli", *args]


class Operator(Process):
    def __init__(self, kubeconfig: Path, namespace: str, log: Path, *extra: str) -> None:
        self.port = free_port()
        super().__init__(tasklease_cmd("operator", f"--kubeconfig={kubeconfig}", f"--namespace={namespace}",
                                       f"--leader-election-namespace={namespace}", f"--http-port={self.port}",
                                       "--http-host=127.0.0.1", "--grace=1", *extra), log=log)

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=2) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()
        except OSError:
            return 0, ""

    def wait_ready(self, role: str = "leader", timeout: float = 60) -> None:
        wait_for(lambda: self.get("/readyz") == (200, f"ready {role}\n"), timeout=timeout,
                 message=f"operator ready as {role}; log:\n{self.output()[-3000:]}")

    def metric(self, name: str) -> float:
        total = 0.0
        for line in self.get("/metrics")[1].splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total


@pytest.fixture
def operator_factory(cluster: Cluster, namespace: str, chart_roles: dict[str, str],
                     tmp_path: Path) -> Iterator[Callable[..., Operator]]:
    """Start operators watching only this test's namespace, as the chart's operator ServiceAccount."""
    kubeconfig = service_account_kubeconfig(cluster, namespace, "tasklease-operator", chart_roles["operator"], tmp_path)
    started: list[Operator] = []

    def start(*extra: str, ready_as: str | None = "leader") -> Operator:
        op = Operator(kubeconfig, namespace, tmp_path / f"operator-{len(started)}.log", *extra)
        started.append(op)
        if ready_as:
            op.wait_ready(ready_as)
        return op

    yield start
    for op in started:
        op.stop()


@pytest.fixture
def operator(operator_factory: Callable[..., Operator]) -> Operator:
    return operator_factory("--no-leader-elect")


def audit_lines(path: Path) -> int:
    """How many events the audit log holds now: where `audit_since` starts."""
    with open(path) as f:
        return sum(1 for _ in f)


def audit_since(path: Path, start: int) -> list[dict[str, Any]]:
    """The audit log's events from the `start`-th on."""
    with open(path) as f:
        return [json.loads(line) for i, line in enumerate(f) if i >= start]


def read_audit(path: Path, *, namespace: str, resource: str | None = None) -> list[dict[str, Any]]:
    """Audit events of one namespace, in the order the API server logged them."""
    out = []
    for part in audit_files(path):  # rotated files too: a long-lived cluster's log rotates
        with open(part) as f:
            for line in f:
                event = json.loads(line)
                ref = event.get("objectRef") or {}
                if ref.get("namespace") == namespace and (resource is None or ref.get("resource") == resource):
                    out.append(event)
    return out

"""Pod-bound leases against the real API server (docs/pod-bound.md): a real operator keeps a bound
lease alive without a renewal from its holder, and expires it when the Pod's container restarts
or the Pod is deleted. Pods here are API objects whose status the test writes, as a kubelet
would (the plain control plane has none); tests/test_node_e2e.py runs real ones. The admission
policy's side (a lease bound only to its writer's own Pod, the operator only renewing one) is in
tests/test_adversarial.py."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import (AGENT_SA, NEVER_SCHEDULED, Cluster, Operator, make_task,
                      service_account_kubeconfig, tasklease_cmd, wait_for)
from tasklease.api.timestamps import format_time, now_utc
from tasklease.kube import EVENTS, LEASES, PODS, TASKS, Kube
from tasklease.protocol import record

# -- a real operator ---------------------------------------------------------------------------------


@dataclass
class ShellPod:
    admin: Kube
    namespace: str
    name: str
    uid: str
    kubeconfig: Path

    def status(self, *, restarts: int = 0, running: bool = True) -> None:
        """Write the Pod's status as its kubelet would."""
        pod = self.admin.get(PODS, self.name)
        state = ({"running": {"startedAt": format_time(now_utc())}} if running
                 else {"terminated": {"exitCode": 1, "reason": "Error"}})
        pod["status"] = {"phase": "Running", "containerStatuses": [{
            "name": "work", "image": "work:dev", "imageID": "", "ready": running, "started": running,
            "restartCount": restarts, "state": state}]}
        self.admin.replace(PODS, pod, sub="status")

    def claim(self, queue: str) -> dict[str, Any]:
        argv = tasklease_cmd("claim", "--queue", queue, "--pod-bound", f"--kubeconfig={self.kubeconfig}")
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                              env={"PATH": "/usr/bin:/bin", "POD_NAME": self.name, "POD_UID": self.uid})
        assert done.returncode == 0, done.stderr
        claimed: dict[str, Any] = json.loads(done.stdout)
        return claimed


@pytest.fixture
def shell_pod(cluster: Cluster, namespace: str, chart_roles: dict[str, str], tmp_path: Path) -> ShellPod:
    """An agent Pod (labelled for the operator), Running, with a token bound to it."""
    admin = cluster.kube(namespace)
    service_account_kubeconfig(cluster, namespace, AGENT_SA, chart_roles["agent"], tmp_path)
    pod = admin.create(PODS, {"apiVersion": "v1", "kind": "Pod",
                              "metadata": {"name": "shell", "labels": {"tasklease.dev/agent": "true"}},
                              "spec": {"serviceAccountName": AGENT_SA, "automountServiceAccountToken": False,
                                       "nodeSelector": NEVER_SCHEDULED,
                                       "containers": [{"name": "work", "image": "work:dev"}]}})
    kubeconfig = service_account_kubeconfig(cluster, namespace, AGENT_SA, chart_roles["agent"], tmp_path, pod=pod)
    shell = ShellPod(admin, namespace, "shell", pod["metadata"]["uid"], kubeconfig)
    shell.status()
    return shell


def _lease(kube: Kube, name: str) -> record.LeaseRecord:
    return record.decode(kube.get(LEASES, name))


def _freed_within(kube: Kube, name: str, epoch: int, since: float) -> float:
    """Seconds from `since` until attempt `epoch` of `name` is over (the Lease no longer held at it)."""
    def over() -> bool:
        rec = _lease(kube, name)
        return rec.state != record.HELD or rec.epoch != epoch
    wait_for(over, timeout=30, interval=0.02, message=f"attempt {epoch} of {name} to end")
    return time.monotonic() - since


def test_a_bound_lease_lives_without_renewals_and_ends_with_its_container(
        shell_pod: ShellPod, operator_factory: Callable[..., Operator]) -> None:
    op = operator_factory("--no-leader-elect")
    admin = shell_pod.admin
    make_task(admin, "long", queue="pb", leaseDurationSeconds=5, backoff={"initialSeconds": 0, "maxSeconds": 0})
    claimed = shell_pod.claim("pb")
    assert claimed["name"] == "long" and claimed["epoch"] == 1
    first = _lease(admin, "long")
    assert first.pod_bound == shell_pod.uid
    # Several lease durations with no renewal from the holder: the operator's keep it.
    deadline = time.monotonic() + 3 * 5 + 2
    renewals = set()
    while time.monotonic() < deadline:
        rec = _lease(admin, "long")
        assert (rec.state, rec.epoch, rec.holder) == (record.HELD, 1, first.holder), f"{rec}\n{op.output()[-3000:]}"
        renewals.add(rec.renewed_at)
        time.sleep(0.5)
    assert len(renewals) >= 4, renewals
    assert op.metric("tasklease_pod_bound_renewals_total") >= 4
    reasons = [e["reason"] for e in admin.list(EVENTS, field_selector="involvedObject.name=long")["items"]]
    assert "PodBound" in reasons
    assert (admin.get(TASKS, "long").get("status") or {}).get("reason") == "PodBound"  # `kubectl get -o wide`
    # Its container restarts: the attempt ends at once, by the operator.
    shell_pod.status(restarts=1)
    took = _freed_within(admin, "long", 1, time.monotonic())
    rec = _lease(admin, "long")
    assert rec.history[-1].outcome == "Expired" and "restarted" in rec.history[-1].message, rec.history
    # The operator renews a bound lease, so only the restart ends it; a lease's length bounds
    # "at once" loosely enough for a loaded machine.
    assert took < 5, f"{took:.2f}s from the container restart to the requeue"
    def counted_once() -> bool:
        expired = [line for line in op.get("/metrics")[1].splitlines()
                   if line.startswith("tasklease_expirations_total{") and 'cause="container-restarted"' in line
                   and 'queue="pb"' in line]
        return bool(expired) and expired[0].endswith(" 1.0")
    # Counted after the Lease write that the wait above saw.
    wait_for(counted_once, message="the container-restarted expiration counted once")


def test_a_bound_lease_ends_when_its_pod_is_deleted(shell_pod: ShellPod,
                                                   operator_factory: Callable[..., Operator]) -> None:
    operator_factory("--no-leader-elect")
    admin = shell_pod.admin
    make_task(admin, "gone", queue="pb", leaseDurationSeconds=30)
    claimed = shell_pod.claim("pb")
    rec = _lease(admin, "gone")
    assert rec.pod_bound == shell_pod.uid
    started = time.monotonic()
    admin.delete(PODS, shell_pod.name)  # never scheduled: gone at once
    took = _freed_within(admin, "gone", claimed["epoch"], started)
    assert took < 10, f"{took:.2f}s from the pod's deletion to the requeue: not the 30 s lease running out"
    assert _lease(admin, "gone").history[-1].outcome == "Expired"


def test_claim_pod_bound_without_a_pod_uid_says_so(cluster: Cluster, namespace: str, tmp_path: Path) -> None:
    make_task(cluster.kube(namespace), "t", queue="pb")
    kubeconfig = cluster.namespaced_kubeconfig(namespace, tmp_path)
    done = subprocess.run(tasklease_cmd("claim", "--queue", "pb", "--pod-bound", f"--kubeconfig={kubeconfig}"),
                          capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "--pod-bound needs this Pod's uid" in done.stderr
    # Nothing was claimed.
    assert cluster.kube(namespace).get_or_none(LEASES, "t") is None

"""`make demo`: a fleet of shell agents on the local control plane, a crash, a requeue.

1. start (or reuse) the local control plane and a fresh namespace `tasklease-demo`;
2. run the operator and submit 12 tasks, one of them poisoned;
3. start three `tasklease run --loop` shell agents; kill one of them with SIGKILL mid-task;
4. watch the operator expire its lease and another agent finish the task, the poisoned
   task get dead-lettered, and everything else succeed; print what kubectl shows.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tasklease.api import errors, models
from tasklease.protocol import record
from tasklease.kube import LEASES, NAMESPACES, TASKS, Kube
from tasklease_dev import binaries
from tasklease_dev.cluster import LocalCluster, free_port
from tasklease_dev.crds import apply_crds

NAMESPACE = "tasklease-demo"
QUEUE = "thumbnails"
AGENT_SCRIPT = r"""
payload=$(cat)
echo "[$TASKLEASE_HOLDER] $TASKLEASE_TASK attempt $TASKLEASE_EPOCH: $payload" >&2
case "$payload" in *'"poison":true'*) echo "cannot decode image" >&2; exit 1;; esac
sleep 2
echo "thumbnail of $TASKLEASE_TASK made by $TASKLEASE_HOLDER (epoch $TASKLEASE_EPOCH)"
"""


def main() -> int:
    root = Path.cwd()
    cluster = LocalCluster(root / ".cache" / "cluster", root / ".cache" / "kubeconfig")
    _say("starting the local control plane (etcd, kube-apiserver, kube-controller-manager)")
    state = cluster.up()
    kubeconfig = Path(state.kubeconfig)
    apply_crds(kubeconfig=kubeconfig, folder=root / "crds")
    kube = _fresh_namespace(Kube.connect(kubeconfig=str(kubeconfig), namespace=NAMESPACE))
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    logs = root / ".cache" / "demo"
    logs.mkdir(parents=True, exist_ok=True)
    port = free_port()
    operator = _spawn(["operator", "--no-leader-elect", "--grace=1",
                       f"--http-port={port}", "--http-host=127.0.0.1"], env, logs / "operator.log")
    agents: list[subprocess.Popen[bytes]] = []
    try:
        _say("submitting 12 tasks to queue 'thumbnails' (lease 6 s, backoff 1 s; one poisoned, maxAttempts 2)")
        for i in range(12):
            spec = {"queue": QUEUE, "payload": {"image": f"img-{i:02d}.png", "poison": i == 7},
                    "priority": 10 if i < 3 else 0, "leaseDurationSeconds": 6, "maxAttempts": 2,
                    "backoff": {"initialSeconds": 1, "maxSeconds": 4}}
            kube.create(TASKS, {"apiVersion": "tasklease.dev/v1alpha1", "kind": "Task",
                                "metadata": {"name": f"thumb-{i:02d}"}, "spec": spec})
        _say("starting 3 shell agents: tasklease run --queue thumbnails --loop -- sh -c '...'")
        for i in range(3):
            agents.append(_spawn(["run", "--queue", QUEUE, "--loop", "--wait", "15", "--", "sh", "-c", AGENT_SCRIPT],
                                 {**env, "POD_NAME": f"agent-{i}"}, logs / f"agent-{i}.log"))
        victim = _wait_for_holder(kube, "agent-0")
        _say(f"agent-0 holds {victim}: killing it with SIGKILL mid-task (no release, no goodbye)")
        agents[0].send_signal(signal.SIGKILL)
        requeue = _wait_requeued(kube, victim, "agent-0", time.monotonic())
        _say(f"the operator expired {victim}'s lease {requeue:.1f} s after agent-0 died; another agent takes it")
        _wait_all_finished(kube, kubeconfig)
        print()
        print(_kubectl(kubeconfig, "get", "tasks", "-o", "wide"))
        print(f"\n$ kubectl describe task {victim}   (the end of it)")
        print("Events:" + _kubectl(kubeconfig, "describe", "task", victim).split("Events:")[-1])
        print(f"operator metrics: http://127.0.0.1:{port}/metrics  (logs in {logs})")
        print("\nexplore it yourself:")
        print(f"  export KUBECONFIG={kubeconfig}")
        print(f"  kubectl -n {NAMESPACE} get tasks; kubectl -n {NAMESPACE} describe task thumb-07")
        print("  make cluster-down   # when you are done")
        return 0
    except errors.TaskleaseError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1
    finally:
        for proc in [*agents, operator]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in [*agents, operator]:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


def _fresh_namespace(kube: Kube) -> Kube:
    if kube.get_or_none(NAMESPACES, NAMESPACE) is not None:
        _say(f"deleting the previous run's namespace {NAMESPACE}")
        kube.delete(NAMESPACES, NAMESPACE)
        deadline = time.monotonic() + 120
        while kube.get_or_none(NAMESPACES, NAMESPACE) is not None:
            if time.monotonic() > deadline:
                raise errors.TaskleaseError(f"namespace {NAMESPACE} is still terminating")
            time.sleep(0.5)
    kube.create(NAMESPACES, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    return kube


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "tasklease.cli", args[0], "-n", NAMESPACE, *args[1:]],
                                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _wait_for_holder(kube: Kube, pod: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for obj in kube.list(LEASES, label_selector=f"{record.LABEL_HOLDER_POD}={pod}")["items"]:
            if record.decode(obj).state == record.HELD:
                return str(obj["metadata"]["name"])
        time.sleep(0.2)
    raise errors.TaskleaseError(f"{pod} claimed nothing within {timeout:.0f}s")


def _wait_all_finished(kube: Kube, kubeconfig: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        tasks = kube.list(TASKS)["items"]
        phases = [(t.get("status") or {}).get("phase", "Pending") for t in tasks]
        summary = ", ".join(f"{p} {phases.count(p)}" for p in models.Phase if phases.count(p))
        if summary != last:
            _say(summary)
            last = summary
        if all(p in models.TERMINAL_PHASES for p in phases):
            return
        time.sleep(0.5)
    raise errors.TaskleaseError(f"tasks not finished after {timeout:.0f}s:\n{_kubectl(kubeconfig, 'get', 'tasks')}")


def _wait_requeued(kube: Kube, name: str, holder_pod: str, since: float, timeout: float = 60) -> float:
    """Seconds from `since` until the dead agent's lease on `name` was expired by the operator."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rec = record.decode(kube.get(LEASES, name))
        if rec.holder_pod != holder_pod:
            return time.monotonic() - since
        time.sleep(0.1)
    raise errors.TaskleaseError(f"{name} was not requeued within {timeout:.0f}s")


def _kubectl(kubeconfig: Path, *args: str) -> str:
    out = subprocess.run([str(binaries.ensure_kubectl()), f"--kubeconfig={kubeconfig}", "-n", NAMESPACE, *args],
                         capture_output=True, text=True)
    return out.stdout.strip()


def _say(message: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {message}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())

"""Recovery: from an agent's SIGKILL to its task's requeue and to its next claim; from a cancel to its holder.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from tasklease.agent.sdk import Agent
from tasklease.kube import PODS, TASKS, Kube
from tasklease.protocol import record
from tasklease_dev.bench.procs import operator, ready, spawn, stop, until
from tasklease_dev.bench.space import create, lease_holder, lease_state, namespace_config

LEASE_S, BACKOFF_S, GRACE_S = 5, 1, 1  # the chaos run's settings; the operator runs with --grace=1
RECLAIM_TARGET_S = LEASE_S + GRACE_S + BACKOFF_S + 2
RECLAIM_WAIT_S = 90  # then the replacement is taken never to claim the task


def requeue_after_kill(kube: Kube, *, kubeconfig: Path, kills: int, pod_fast_path: bool) -> list[float]:
    """Kill `kills` holders at once; seconds until each task is claimable again."""
    ns_config = namespace_config(kube, kubeconfig)
    op, port = operator(kube, kubeconfig)
    agents = []
    try:
        for i in range(kills):
            pod = f"victim-{i}"
            create(kube, pod, queue=pod, leaseDurationSeconds=5, backoff={"initialSeconds": 0, "maxSeconds": 0})
            if pod_fast_path:
                kube.create(PODS, {"apiVersion": "v1", "kind": "Pod",
                                   "metadata": {"name": pod, "labels": {"tasklease.dev/agent": "true"}},
                                   "spec": {"automountServiceAccountToken": False,
                                            "containers": [{"name": "a", "image": "agent:dev"}]}})
            # The command outlives its killed agent a little: short enough to end by itself.
            agents.append(spawn(["run", f"--kubeconfig={ns_config}", "--queue", pod, "--", "sleep", "20"],
                                 env={"POD_NAME": pod}))
        until(lambda: all(lease_state(kube, f"victim-{i}") == record.HELD for i in range(kills)), 60, "agents to claim")
        until(lambda: ready(port), 60, "the operator to be ready")
        time.sleep(1)  # the operator has seen the held leases
        killed_at = time.monotonic()
        for proc in agents:
            proc.send_signal(signal.SIGKILL)
        if pod_fast_path:
            for i in range(kills):
                kube.delete(PODS, f"victim-{i}")
        freed: dict[str, float] = {}

        def all_freed() -> bool:
            for i in range(kills):
                name = f"victim-{i}"
                if name not in freed and lease_state(kube, name) == record.FREE:
                    freed[name] = time.monotonic() - killed_at
            return len(freed) == kills
        until(all_freed, 60, "every lease to be freed", interval=0.05)
        return list(freed.values())
    finally:
        for proc in [*agents, op]:
            stop(proc)


def reclaim_after_kill(kube: Kube, *, kubeconfig: Path, agents: int = 8, kills: int, same_pod: bool) -> list[float]:
    """`agents` shell agents (`tasklease run`) each hold a task (lease 5 s, backoff 1 s, no
    jitter); one at a time is SIGKILLed and a replacement starts at once, with the killed
    agent's pod name or a new one. Seconds from the kill to the next claim of the killed
    agent's task (its Lease held by another holder), for each kill. The other agents are busy:
    only the replacement can take it."""
    ns_config = namespace_config(kube, kubeconfig)
    op, port = operator(kube, kubeconfig)
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(pod: str) -> None:
        # The command runs as long as its agent does (it is in a session of its own: a kill
        # of the agent does not reach it).
        procs[pod] = spawn(["run", f"--kubeconfig={ns_config}", "--queue", "reclaim", "--wait", "300", "--",
                            "sh", "-c", "while kill -0 $PPID 2>/dev/null; do sleep 1; done"], env={"POD_NAME": pod})
    try:
        for i in range(agents):  # no spare: a free task would draw the replacement away from the killed one
            create(kube, f"r-{i:03d}", queue="reclaim", leaseDurationSeconds=LEASE_S,
                   backoff={"initialSeconds": BACKOFF_S, "maxSeconds": BACKOFF_S, "jitter": False})
        until(lambda: ready(port), 120, "the operator to be ready")
        for i in range(agents):
            start(f"agent-{i}")
        times = []
        for k in range(kills):
            pod = f"agent-{k}"
            until(lambda: any(lease_holder(kube, f"r-{i:03d}").startswith(f"{pod}/")  # noqa: B023
                              for i in range(agents)), 120, f"{pod} to hold a task")
            task = next(f"r-{i:03d}" for i in range(agents)
                        if lease_holder(kube, f"r-{i:03d}").startswith(f"{pod}/"))
            held_by = lease_holder(kube, task)
            time.sleep(1)  # the operator has seen the held lease
            killed_at = time.monotonic()
            procs.pop(pod).send_signal(signal.SIGKILL)
            start(pod if same_pod else f"{pod}-new")
            try:
                until(lambda: lease_holder(kube, task) not in ("", held_by), RECLAIM_WAIT_S,  # noqa: B023
                      f"{task} to be claimed again", interval=0.05)
            except TimeoutError:
                pass  # the time waited stands as the figure: at least that long, far past the target
            times.append(time.monotonic() - killed_at)
        return times
    finally:
        for proc in [*procs.values(), op]:
            stop(proc)


def cancel_to_holder(kube: Kube, *, rounds: int) -> list[float]:
    """From the cancel request to the holder's work being stopped (its `lost` event), with a
    lease of 300 s: without the holder's watch on its task this would wait for the renewal
    every 100 s. No operator runs: the holder hears it from the API server directly."""
    agent = Agent(kube)
    times = []
    try:
        for i in range(rounds):
            create(kube, f"cancel-{i}", queue="cancel", leaseDurationSeconds=300)
            task = agent.claim("cancel", timeout=60, interrupt=False)
            time.sleep(0.5)  # the holder's watch is up
            started = time.monotonic()
            kube.merge_patch(TASKS, task.name, {"spec": {"cancel": True}})
            if not task.lost.wait(60):
                raise RuntimeError(f"the holder of {task.name} never heard of its cancel")
            times.append(time.monotonic() - started)
    finally:
        agent.close()
    return times

"""Cases with agents at work: drains, idle agents beside renewals, the operator's writes and lag, the one-shot claim.
"""

from __future__ import annotations

import functools
import math
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from tasklease.agent.sdk import Agent, ClaimedTask, Identity
from tasklease.api.timestamps import parse_time
from tasklease.kube import JSON, LEASES, TASKS, Kube
from tasklease.kube.watching import Reflector
from tasklease.protocol import Held, members
from tasklease_dev.bench.floors import floor_lease, get_put_floor
from tasklease_dev.bench.harness import run_workers
from tasklease_dev.bench.procs import metric, operator, ready, status_mb, stop, until
from tasklease_dev.bench.space import create, create_tasks, phase_is

Results = dict[str, Any]


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) >= 2 else (values[0] if values else math.nan)


def sdk_case(kube: Kube, *, kubeconfig: Path, workers: int, depth: int, drain: int) -> Results:
    """`depth` open tasks, `workers` agents; the rate at which they drain `drain` of them.
    From a deeper queue, each agent takes twice its share and the rate runs to the `drain`th
    completion of all: a quota of exactly its share would make the rate wait for the
    slowest agent's last task, while the others, in a deep queue, would go on working."""
    create_tasks(kube, depth, queue="bench", kubeconfig=kubeconfig)
    if drain >= depth:
        return run_workers("sdk", kube, kubeconfig=kubeconfig, workers=workers, tasks=drain)
    return run_workers("sdk", kube, kubeconfig=kubeconfig, workers=workers, tasks=drain,
                        max_tasks=math.ceil(2 * drain / workers), measure=drain)


def renewals(kube: Kube, *, kubeconfig: Path, held: int = 40, idle: int = 4, seconds: float = 10.0) -> Results:
    """Idle agents beside `held` leases renewed every 5/3 s: how often does a renewal wake one?"""
    create_tasks(kube, held, queue="bench", leaseDurationSeconds=5)
    holder = Agent(kube, identity=Identity(pod="holder", instance="bench"))
    renewals = [0]
    counting = threading.Event()
    renew = holder.protocol.renew

    def counted(*a: Any, **kw: Any) -> Held:
        out = renew(*a, **kw)
        if counting.is_set():
            renewals[0] += 1
        return out
    holder.protocol.renew = counted  # type: ignore[method-assign]
    tasks: list[ClaimedTask] = [holder.claim("bench", timeout=60) for _ in range(held)]
    try:
        window = run_workers("idle", kube, kubeconfig=kubeconfig, workers=idle, tasks=0, seconds=seconds,
                              on_go=counting.set)
        counting.clear()
    finally:
        for task in tasks:
            task.release()
        holder.close()
    per_agent = statistics.mean(window["wakeups"])
    return {"renewals_in_window": renewals[0],
            "renewal_wakeups_per_idle_agent": per_agent / max(renewals[0], 1),
            "idle_agent_cpu_ms_per_renewal": statistics.mean(window["cpu_s"]) * 1000 / max(renewals[0], 1)}


def operator_flow(kube: Kube, *, kubeconfig: Path, tasks: int = 1000, rate: float = 100.0,
                   agents: int = 8) -> Results:
    """Tasks arrive at `rate`/s, `agents` drain them, the operator projects: writes and lag.
    The first task arrives once every agent waits in a claim, as the agents of a flow do
    between its tasks: an agent that has yet to say so (`members.WAITING_S`) is not counted on
    to take its shards' tasks, and its peers read the queue for them too (`Agent._beyond`),
    taking some that their own watches never show projected, which they tell in a write."""
    op, port = operator(kube, kubeconfig)
    succeeded: dict[str, float] = {}
    lags: list[float] = []

    def seen(kind: str, obj: JSON) -> None:
        status = obj.get("status") or {}
        name = obj["metadata"]["name"]
        if status.get("phase") == "Succeeded" and name not in succeeded:
            succeeded[name] = time.time()
            done_at = parse_time(status.get("completedAt"))
            if done_at is not None:
                lags.append(succeeded[name] - done_at.timestamp())
    watch = Reflector(kube, TASKS, namespace=kube.namespace, listener=seen, keep_objects=False)
    watch.start()
    try:
        until(lambda: ready(port), 120, "the operator to be ready")

        def produce() -> None:
            until(lambda: _waiting(kube) >= agents, 60, "every agent waiting in a claim")
            start = time.monotonic()
            for i in range(tasks):
                time.sleep(max(start + i / rate - time.monotonic(), 0))
                create(kube, f"flow-{i:06d}", queue="bench")
        # The agents stay until the operator has projected their last claims (the lag's target):
        # one that left sooner would tell them in its leaving write, a write per agent and stop.
        report = run_workers("sdk", kube, kubeconfig=kubeconfig, workers=agents, tasks=tasks, linger_s=2.0,
                              on_go=lambda: threading.Thread(target=produce, daemon=True).start())
        until(lambda: len(succeeded) >= tasks, 300, "every task projected Succeeded")
        status_writes = metric(port, "tasklease_status_writes_total", 'result="ok"')
        events = metric(port, "tasklease_events_posted_total")
    finally:
        watch.stop()
        stop(op)
    # One claim and one completion each (409s are not successful writes), and the member Lease
    # writes that told of claims (those the operator had not projected when told). The
    # members' liveness writes are per agent and time, as the operator's leader Lease
    # renewals are: shown beside, per agent and minute.
    agent_writes = 2 * tasks + report["member_told"]
    minutes = report["done"] / report["rate"] / 60
    return {"writes_per_task_operator": (agent_writes + status_writes + events) / tasks,
            "status_writes_per_task": status_writes / tasks, "events_per_task": events / tasks,
            "member_told_per_task": report["member_told"] / tasks,
            "member_liveness_per_agent_min": report["member_liveness"] / agents / minutes,
            "projection_lag_p50_s": statistics.median(lags), "projection_lag_p99_s": p99(lags),
            "flow_conflicts_per_task": report["conflicts"] / tasks}


def _waiting(kube: Kube) -> int:
    """How many members of queue "bench" say that a claim of theirs waits for a task."""
    return sum(member.holder != "" and member.waiting for member in map(members.decode, kube.list(
        LEASES, namespace=kube.namespace, label_selector=members.selector("bench"))["items"]))


def cli_and_operator_at_depth(kube: Kube, *, kubeconfig: Path, depth: int, suffix: str,
                               claims: int = 30) -> Results:
    """`depth` open tasks: the operator's memory and time to work through them as a backlog,
    then the one-shot claim (`tasklease claim`'s path) with the operator keeping up."""
    create_tasks(kube, depth, queue="bench", kubeconfig=kubeconfig)
    started = time.monotonic()
    op, port = operator(kube, kubeconfig)
    try:
        until(lambda: ready(port), 3600, "the operator to work through its backlog", interval=1.0)
        backlog_s = time.monotonic() - started
        rss = status_mb(op.pid, "VmRSS")
        latencies, floor = [], []
        agent = Agent(kube, identity=Identity(pod="cli", instance="bench"))
        floor_lease(kube)
        for i in range(claims):
            began = time.perf_counter()
            task = agent.claim_once("bench")
            latencies.append(time.perf_counter() - began)
            task.complete("ok")
            # As between two shell claims: the operator has projected the last one.
            until(functools.partial(phase_is, kube, task.name, "Succeeded"), 30, "the claimed task to be projected")
            # Each claim paired with a floor in the same conditions: the operator running, the
            # same tasks in the namespace, the same moment's load.
            floor.append(get_put_floor(kube, i)[1])
    finally:
        stop(op)
    out: Results = {f"operator_rss_mb_{suffix}": rss, f"operator_backlog_s_{suffix}": backlog_s}
    if latencies:
        out[f"cli_claim_p50_s_{suffix}"] = statistics.median(latencies)
        out[f"cli_floor_get_put_p50_s_{suffix}"] = statistics.median(floor)
        out[f"cli_claim_vs_floor_{suffix}"] = statistics.median(latencies) / statistics.median(floor)
    return out



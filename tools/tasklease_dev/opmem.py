"""The operator's memory per task, measured in seconds without an API server.

`python -m tasklease_dev.opmem [--tasks N] [--open] [--top K]` prints, measured in a fresh
process, what the operator holds for N Tasks that each went through what `make bench`'s
scale case does to them: created (as the API server stores a bench task: managedFields, the
rank label, the CRD's defaults) and projected Pending; then claimed by an agent (its Lease
created held, as the SDK writes it), finished (the Lease closed Succeeded with a result and
one attempt in its history) and projected Succeeded (`--open`: never claimed, the first part
alone). Every event goes through the operator's own watch wiring (`controller._reflectors`:
the Reflectors, the reconciler's store, the pod-bound and TaskQueue listeners), and every
reconcile is the reconciler's own, its status writes answered by a fake API server (`_Kube`)
as a real one would (a new resourceVersion). Our own status writes come back through the
Task watch, as they do.

The figures: RSS and traced bytes before and after, per task, and `--top` allocation sites
(tracemalloc, by file and line) of what is still held at the end.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from tasklease_dev.agentmem import NAMESPACE, allocations, child_report, print_allocations, task_json
from tasklease_dev.bench.procs import status_mb

_HOLDERS = 16  # agents, as the scale case starts


class _Kube:
    """What the reconciler asks of the API server on the happy path: status writes (answered
    at the next resourceVersion) and the time. Anything else is a probe that went wrong."""

    namespace = NAMESPACE

    def __init__(self, start: datetime) -> None:
        self.time = start
        self.rv = 10_000_000
        self.lock = threading.Lock()

    def now(self) -> datetime:
        return self.time

    def next_rv(self) -> str:
        with self.lock:
            self.rv += 1
            return str(self.rv)

    def replace(self, res: Any, body: dict[str, Any], *, sub: str | None = None, **_: Any) -> dict[str, Any]:
        assert sub == "status", f"the probe expected status writes only, not a {res.plural} write"
        return {**body, "metadata": {**body["metadata"], "resourceVersion": self.next_rv()}}

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the probe's API server has no {name}: the reconciler left the happy path")


def _uid(i: int, kind: str) -> str:
    """A random uid, as the API server makes them (they deflate no better than that), the same each time."""
    return str(uuid.UUID(int=random.Random(f"{kind}{i}").getrandbits(128), version=4))


def _task(i: int, start: datetime) -> dict[str, Any]:
    """Task `i`, labelled as producers label it (the operator would otherwise label it first)."""
    from tasklease.protocol import labels
    task = labels.labelled(task_json(i, start))
    task["metadata"]["uid"] = _uid(i, "Task")
    return task


def _lease(i: int, rec: Any, rv: str, created: str) -> dict[str, Any]:
    """`rec` as the API server answers it: uid, resourceVersion, creationTimestamp added."""
    from tasklease.protocol import record
    body = record.encode(rec)
    body["metadata"].update(uid=_uid(i, "Lease"), resourceVersion=rv, creationTimestamp=created)
    return body


def _fill(tasks: int, top: int, *, claimed: bool = True) -> dict[str, Any]:
    """In this process: the operator's wiring fed `tasks` Tasks through their whole lifecycle."""
    import tracemalloc

    from tasklease.operator import controller
    from tasklease.operator.health import WatchHealth
    from tasklease.operator.podbound import PodBound
    from tasklease.operator.queues import QueueController
    from tasklease.operator.reconciler import Reconciler
    from tasklease.protocol import TaskView, rules

    start = datetime(2026, 1, 1, tzinfo=UTC)
    kube = _Kube(start)
    reconciler = Reconciler(kube, grace_s=1.0, namespaces=[NAMESPACE], clock=kube.now,  # type: ignore[arg-type]
                            monotonic=time.monotonic)
    reconciler.active.set()
    podbound = PodBound(kube, active=reconciler.active)  # type: ignore[arg-type]
    queues = QueueController(kube, claimable=reconciler.claimable, active=reconciler.active)  # type: ignore[arg-type]
    health = argparse.Namespace(watches=WatchHealth())
    task_watch, lease_watch = controller._reflectors(reconciler, podbound, queues, kube,  # type: ignore[arg-type]
                                                     [NAMESPACE], health)  # type: ignore[arg-type]

    def reconcile(name: str) -> None:
        key = (NAMESPACE, name)
        reconciler.reconcile(key)
        reconciler.queue.get()  # what the watch events queued: taken, as a worker does
        reconciler.queue.done(key)

    def echo(name: str) -> None:
        """Our own status write comes back through the Task watch."""
        entry = reconciler.store.task((NAMESPACE, name))
        assert entry is not None
        task_watch._event("MODIFIED", entry.json())

    base, cpu = status_mb("self", "VmRSS"), time.process_time()
    if top:
        tracemalloc.start(3)
    names = []
    for i in range(tasks):
        task = _task(i, start)
        names.append(task["metadata"]["name"])
        task_watch._event("ADDED", task)
        reconcile(names[-1])
        echo(names[-1])
    for i in range(tasks if claimed else 0):
        task, name = _task(i, start), names[i]
        view = TaskView.of(task)
        at = start + timedelta(seconds=60 + i / 100)
        holder = f"bench-{i % _HOLDERS}/{100_000 + i % _HOLDERS}"
        held = rules.claimed(view, None, holder, at)
        lease_watch._event("ADDED", _lease(i, held, kube.next_rv(), created=at.strftime("%Y-%m-%dT%H:%M:%SZ")))
        closed = rules.ended(held, outcome="Succeeded", now=at + timedelta(milliseconds=20), close="Succeeded",
                             reason="Completed", result="ok")
        lease_watch._event("MODIFIED", _lease(i, closed, kube.next_rv(),
                                              created=at.strftime("%Y-%m-%dT%H:%M:%SZ")))
        reconcile(name)
        echo(name)
    phases = [e.projected[1] for n in names if (e := reconciler.store.task((NAMESPACE, n))) and e.projected]
    out: dict[str, Any] = {"tasks": tasks, "succeeded": phases.count("Succeeded"), "pending": phases.count("Pending"),
                           "rss_before_mb": base,
                           "rss_after_mb": status_mb("self", "VmRSS"), "hwm_mb": status_mb("self", "VmHWM"),
                           "cpu_s": time.process_time() - cpu}
    out["bytes_per_task"] = (out["rss_after_mb"] - base) * 2**20 / max(tasks, 1)
    if top:
        out.update(allocations(top, tasks))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tasklease_dev.opmem", description=__doc__)
    parser.add_argument("--tasks", type=int, default=100_000, help="tasks, each claimed and finished (default 100,000)")
    parser.add_argument("--open", action="store_true", help="tasks never claimed: created and projected Pending")
    parser.add_argument("--top", type=int, default=0, help="also trace allocations: the N largest sites")
    parser.add_argument("--fill", action="store_true", help=argparse.SUPPRESS)  # in the child
    args = parser.parse_args(argv)
    if args.fill:
        print(json.dumps(_fill(args.tasks, args.top, claimed=not args.open)))
        return 0
    got = child_report("tasklease_dev.opmem", "--fill", "--tasks", str(args.tasks), "--top", str(args.top),
                       *(["--open"] if args.open else []))
    per = got["bytes_per_task"]
    held = f"{got['pending']:,} open" if args.open else f"{got['succeeded']:,} finished, projected Succeeded"
    print(f"operator holding {got['tasks']:,} tasks ({held}): RSS "
          f"{got['rss_before_mb']:.1f} -> {got['rss_after_mb']:.1f} MB, {per:.0f} B/task "
          f"({per * 100_000 / 2**20:.0f} MB per 100,000), peak {got['hwm_mb']:.1f} MB, {got['cpu_s']:.1f} s CPU")
    print_allocations(got)
    return 0


if __name__ == "__main__":
    sys.exit(main())

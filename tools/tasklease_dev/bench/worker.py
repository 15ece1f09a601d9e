"""One bench worker process: an SDK agent, or a floor that makes the same writes without the SDK.

Started by `harness.Workers` as `python -m tasklease_dev.bench --worker <mode>`, one process
per worker (as agents are separate pods); it prints `ready <seconds>`, waits for `go` on its
stdin, works, and prints its report as one JSON line. An SDK agent works until the case's
tasks are all done: it adds a byte to the case's `--progress` file per task it completes,
and the case says `stop` on its stdin once the file holds them all.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from tasklease.agent.sdk import Agent, Identity
from tasklease.api import errors, models
from tasklease.kube import JSON, LEASES, TASKS, Kube
from tasklease.kube.watching import Reflector
from tasklease.operator import projection
from tasklease.protocol import Held, Protocol, TaskView
from tasklease_dev.bench.procs import cpu_s, status_mb
from tasklease_dev.bench.space import queue_of

Results = dict[str, Any]

# The floors: bare Lease writes, the shares known in advance ("raw": a claim and a close per
# task); the same plus the Task status write the operator makes for each task, still with no
# watch ("raw3": the floor of an SDK drain with the operator on); the raw writes by workers
# that each watch every Lease of the queue, skip what they have seen taken and try the rest
# in an order of their own, a 409 meaning taken ("watched"); and the SDK's own Lease writes
# (`Protocol.claim`, `complete`: labels, owner, history) the same way ("protocol"). Beside
# "raw3", the same three writes with the product's objects, still with no watch and no races
# ("objects3"): the SDK's Lease writes, and the status the operator projects for the finished
# task, sent as the operator sends it (what the objects cost, apart from watches and the operator).
FLOORS = ("raw", "raw3", "watched", "protocol", "objects3")
THROUGHPUT_FLOORS = ("raw", "watched", "protocol")  # the operator-off section's, one step nearer the SDK each
MODES = (*FLOORS, "sdk", "idle", "first")

Take = Callable[[str], Callable[[], Any]]  # takes a task (Conflict if another worker did); returns its letting go
# An agent stays at work until its case is over, as the agents of a Deployment do: one that left
# once its own share was done would move its shards to its peers mid-drain, and their new
# watches would list them again. This long without a task, it leaves anyway (the case failed).
_GIVE_UP_S = 60.0


class Meter:
    """Where a worker's CPU goes, marked when its clock starts, at every task it completes and
    when it ends: (wall clock, process CPU, main thread CPU, main thread CPU in requests). The
    case reads them at its own end (`harness.cpu_until`), which a worker does not know. It
    also counts the watch events the worker's client receives, bookmarks aside."""

    def __init__(self, kube: Kube) -> None:
        self.marks: list[tuple[float, float, float, float]] = []
        self.watch_events = 0
        self._in_requests = 0.0
        request, main = kube.request, threading.main_thread()

        def timed(*args: Any, **kwargs: Any) -> JSON:
            if threading.current_thread() is not main:
                return request(*args, **kwargs)
            began = time.thread_time()
            try:
                return request(*args, **kwargs)
            finally:
                self._in_requests += time.thread_time() - began
        kube.request = timed  # type: ignore[method-assign]
        # Every watch the client offers (the agent may watch whole objects or metadata only).
        for name in [n for n in dir(kube) if n.startswith("watch") and callable(getattr(kube, n))]:
            setattr(kube, name, self._counted(getattr(kube, name)))

    def _counted(self, watch: Callable[..., Iterator[JSON]]) -> Callable[..., Iterator[JSON]]:
        def counted(*args: Any, **kwargs: Any) -> Iterator[JSON]:
            for event in watch(*args, **kwargs):
                if event.get("type") != "BOOKMARK":
                    self.watch_events += 1
                yield event
        return counted

    def mark(self) -> None:
        """On the main thread."""
        self.marks.append((time.time(), cpu_s(), time.thread_time(), self._in_requests))


def run(args: argparse.Namespace) -> Results:
    if args.worker == "first":
        return _first(args)
    kube = Kube.connect(kubeconfig=args.kubeconfig)
    meter = Meter(kube)
    latencies: list[float] = []
    completions: list[float] = []  # when each task was completed (the SDK's)
    conflicts = done = 0
    last = time.time()
    report: Results = {}
    if args.worker in FLOORS:
        take, names, taken = _floor_writes(kube, args)
        print("ready 0", flush=True)
        _wait_for_go()
        cpu = cpu_s()
        meter.mark()
        for name in names:
            if name in taken:
                continue
            started = time.perf_counter()
            try:
                let_go = take(name)
            except errors.Conflict:
                conflicts += 1
                continue
            latencies.append(time.perf_counter() - started)
            let_go()
            meter.mark()
            done += 1
        last = time.time()
        report = {"cpu_s": cpu_s() - cpu}
    else:
        agent = Agent(kube, identity=Identity(pod=f"bench-{args.index}", instance=f"{os.getpid()}"))
        synced = time.monotonic()
        # A working agent is a member of its queue before the clock starts, as it would be at
        # work: joining (its member Lease written, and seen) and listing the queue are once per
        # agent, not per task (the scale case measures an agent's start).
        queue = queue_of("bench", args.index, args.queues)
        view = agent.watch(queue) if args.worker == "idle" else agent.join(queue)
        if not view.wait_listed(3600):
            raise RuntimeError("bench: the queue's first list did not end within an hour")
        print(f"ready {time.monotonic() - synced:.3f}", flush=True)
        _wait_for_go()
        events = meter.watch_events
        if args.worker == "idle":
            wakeups, cpu = view.wakeups, cpu_s()
            time.sleep(args.seconds)
            report = {"wakeups": view.wakeups - wakeups, "cpu_s": cpu_s() - cpu}
        else:
            claim, complete = agent.protocol.claim, agent.protocol.complete
            progress = os.open(args.progress, os.O_WRONLY | os.O_APPEND)

            def timed_claim(*a: Any, **kw: Any) -> Held:
                nonlocal conflicts
                started = time.perf_counter()
                try:
                    held = claim(*a, **kw)
                except errors.Conflict:
                    conflicts += 1
                    raise
                latencies.append(time.perf_counter() - started)
                return held

            def timed_complete(*a: Any, **kw: Any) -> Held:
                nonlocal last
                held = complete(*a, **kw)
                meter.mark()
                last = time.time()
                completions.append(last)
                os.write(progress, b".")
                return held
            agent.protocol.claim = timed_claim  # type: ignore[method-assign]
            agent.protocol.complete = timed_complete  # type: ignore[method-assign]
            stop = threading.Event()
            threading.Thread(target=_wait_for_stop, args=(stop,), daemon=True).start()
            cpu = cpu_s()
            meter.mark()
            done = agent.work(queue, lambda task: "ok", idle_timeout=_GIVE_UP_S, stop=stop,
                              max_tasks=args.max_tasks or None)
            report = {"cpu_s": cpu_s() - cpu}
            os.close(progress)
        report["watch_events"] = meter.watch_events - events
        agent.close()
        writes = agent.member_writes()
        report.update(member_told=writes.told, member_liveness=writes.liveness)
    if meter.marks:
        meter.mark()
    return {"done": done, "latencies": latencies, "conflicts": conflicts, "last": last, "completions": completions,
            "rss_mb": status_mb("self", "VmHWM"), "marks": meter.marks, **report}


def _floor_writes(kube: Kube, args: argparse.Namespace) -> tuple[Take, list[str], set[str]]:
    """How this floor worker takes a task, its tasks in its order, and the ones seen taken
    (kept current by its watch)."""
    taken: set[str] = set()
    share = [f"t-{i:06d}" for i in range(args.index, args.tasks, args.workers)]  # no races: the floors
    if args.worker in ("raw", "raw3"):
        return _bare_take(kube, args.index, status=args.worker == "raw3"), share, taken
    if args.worker == "objects3":  # its tasks read before the clock starts
        tasks = {t["metadata"]["name"]: t for page in kube.list_pages(TASKS, limit=500) for t in page["items"]}
        return _objects_take(kube, args.index, tasks), share, taken
    watch = Reflector(kube, LEASES, namespace=kube.namespace, keep_objects=False,
                      listener=lambda kind, obj: taken.add(obj["metadata"]["name"]))
    watch.start()
    watch.synced.wait(60)
    if args.worker == "watched":
        take, names = _bare_take(kube, args.index, status=False), [f"t-{i:06d}" for i in range(args.tasks)]
    else:
        views = {v.name: v for v in (TaskView.of(t) for page in kube.list_pages(TASKS, limit=500)
                                     for t in page["items"])}
        protocol, holder = Protocol(kube), Identity(pod=f"bench-{args.index}", instance=f"{os.getpid()}").holder

        def take(name: str) -> Callable[[], Any]:
            held = protocol.claim(views[name], None, holder)
            return lambda: protocol.complete(held, "ok")
        names = sorted(views)
    random.Random(args.index).shuffle(names)
    return take, names, taken


def _bare_take(kube: Kube, index: int, *, status: bool) -> Take:
    def take(name: str) -> Callable[[], Any]:
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": name},
                "spec": {"holderIdentity": f"w{index}", "leaseDurationSeconds": 30, "leaseTransitions": 1}}
        created = kube.create(LEASES, body)
        created["spec"]["holderIdentity"] = None

        def let_go() -> None:
            kube.replace(LEASES, created)
            if status:  # what the operator's projection writes once the task is done
                kube.request("PATCH", TASKS.path(kube.namespace, name, "status"),
                             body={"status": {"phase": "Succeeded", "reason": "Completed"}},
                             content_type="application/merge-patch+json")
        return let_go
    return take


def _objects_take(kube: Kube, index: int, tasks: dict[str, JSON]) -> Take:
    protocol = Protocol(kube)
    holder = Identity(pod=f"bench-{index}", instance=f"{os.getpid()}").holder

    def take(name: str) -> Callable[[], Any]:
        task = tasks[name]
        held = protocol.claim(TaskView.of(task), None, holder)

        def let_go() -> None:
            done = protocol.complete(held, "ok")
            status = projection.project(task, done.record, old=models.TaskStatus(), now=kube.now())
            kube.replace(TASKS, projection.status_write(task, status), sub="status")
        return let_go
    return take


def _wait_for_go() -> None:
    """A worker's start: a line on its stdin from `Workers.go` (a blocked read costs no CPU
    while the cases before it run)."""
    sys.stdin.readline()


def _wait_for_stop(stop: threading.Event) -> None:
    """The case is over: `stop` on our stdin from `Workers.go` (or its end, the case gone)."""
    sys.stdin.readline()
    stop.set()


def _first(args: argparse.Namespace) -> Results:
    """An agent as it starts in a new pod: no head start, no `go`. It works the queue until
    it is empty and reports when it first claimed and when its list of the queue ended (wall
    clock), its completions and its peak memory."""
    agent = Agent(Kube.connect(kubeconfig=args.kubeconfig),
                  identity=Identity(pod=f"bench-{args.index}", instance=f"{os.getpid()}"))
    claim, complete = agent.protocol.claim, agent.protocol.complete
    first: list[float] = []
    completions: list[float] = []

    def timed_claim(*a: Any, **kw: Any) -> Held:
        held = claim(*a, **kw)
        if not first:
            first.append(time.time())
        return held

    def timed_complete(*a: Any, **kw: Any) -> Held:
        held = complete(*a, **kw)
        completions.append(time.time())
        return held
    agent.protocol.claim = timed_claim  # type: ignore[method-assign]
    agent.protocol.complete = timed_complete  # type: ignore[method-assign]
    cpu = cpu_s()
    done = agent.work("bench", lambda task: "ok", idle_timeout=5.0)
    tasks = agent.watch("bench").task_watch
    report = {"done": done, "first_claim": first[0] if first else None, "completions": completions,
              "rss_mb": status_mb("self", "VmHWM"), "cpu_s": cpu_s() - cpu, "listed": tasks.synced_at,
              "lists_cut_short": tasks.cut_short, "pages_retried": tasks.retried}
    agent.close()
    return report

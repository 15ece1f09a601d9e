"""Cases run side by side: worker processes made ready first, then let go, and pairs of cases in alternating order.

A shared machine's speed changes from one minute to the next (the raw floor alone by a
factor of several): a ratio of two rates is only as good as their closeness in time. So the
cases of a ratio run one right after the other, in several pairs whose order alternates, and
the ratio is taken over each two pairs in turn, one in each order (`ratio`). Each case is
made ready just before it runs and its namespace is gone before the next one is made ready:
a case's workers alive beside another case's run would weigh on it, and unevenly. Idle floor
workers cost nothing, but an SDK fleet keeps its watches and member Leases, settles its
shards for a moment after its agents are ready, and has the operator beside it. Each case's
clock starts once what its setup set going is over (`Workers.settle`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tasklease.kube import Kube
from tasklease_dev.bench.procs import control_plane, operator, process_cpu_s, ready, stop, until
from tasklease_dev.bench.space import create_tasks, namespace, namespace_config

Results = dict[str, Any]
_SAMPLE_S = 0.05  # how often a case reads the control plane's CPU
# A case is let go once its processes and the control plane have used less than this share of
# one CPU over the last `_QUIET_WINDOW_S` (an SDK fleet whose agents are ready still divides
# its shards among the last to join, and the operator looks at every task once), or after
# `_QUIET_MAX_S` regardless.
_QUIET_SHARE, _QUIET_WINDOW_S, _QUIET_MAX_S = 0.2, 1.0, 60.0


def percentiles(latencies: list[float]) -> dict[str, float]:
    if len(latencies) < 2:
        return {}
    q = statistics.quantiles(latencies, n=20)
    return {"p50": statistics.median(latencies), "p95": q[18]}


class Workers:
    """Worker processes started and ready (connected; an agent has joined and listed its queue), each
    blocked on its stdin until `go`: one per worker, as agents are separate pods."""

    def __init__(self, mode: str, kube: Kube, *, kubeconfig: Path, workers: int, tasks: int, max_tasks: int = 0,
                 seconds: float = 0.0, beside: dict[str, int] | None = None, measure: int = 0,
                 queues: int = 1, linger_s: float = 0.0) -> None:
        """`linger_s`: how long the agents stay once every task is done."""
        self.mode, self.tasks, self.measure, self.linger_s = mode, tasks, measure, linger_s
        config = namespace_config(kube, kubeconfig)
        # A byte per task completed, from every agent: the case is over when it holds them all.
        fd, progress = tempfile.mkstemp(prefix="tasklease-bench-", suffix=".progress")
        os.close(fd)
        self.progress = Path(progress)
        self.procs = [subprocess.Popen([sys.executable, "-m", "tasklease_dev.bench", "--worker", mode,
                                        "--kubeconfig", str(config), "--index", str(i), "--tasks", str(tasks),
                                        "--workers", str(workers), "--max-tasks", str(max_tasks),
                                        "--seconds", str(seconds), "--queues", str(queues),
                                        "--progress", progress],
                                       stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True)
                      for i in range(workers)]
        self.plane = {**control_plane(kubeconfig), **(beside or {})}
        self.sync = []
        try:
            for proc in self.procs:
                assert proc.stdout is not None
                line = proc.stdout.readline().strip()
                if not line.startswith("ready"):
                    raise RuntimeError(f"bench worker ({mode}) did not start")
                self.sync.append(float(line.split()[1]))
        except BaseException:
            self.kill()
            raise

    def settle(self) -> float:
        """Wait until the case is quiet (`_QUIET_SHARE`): what its setup set going is over
        before its clock starts, as it is for a floor's idle workers. The seconds waited."""
        watched = {**self.plane, **{f"worker-{i}": p.pid for i, p in enumerate(self.procs)}}
        began = time.monotonic()
        window = [(began, sum(process_cpu_s(watched).values()))]
        while time.monotonic() - began < _QUIET_MAX_S:
            time.sleep(_SAMPLE_S * 4)
            window.append((time.monotonic(), sum(process_cpu_s(watched).values())))
            while window[-1][0] - window[1][0] >= _QUIET_WINDOW_S:
                window.pop(0)
            elapsed = window[-1][0] - window[0][0]
            if elapsed >= _QUIET_WINDOW_S and window[-1][1] - window[0][1] < _QUIET_SHARE * elapsed:
                break
        return time.monotonic() - began

    def kill(self) -> None:
        """Ours: a worker left waiting for `go` would wait forever."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdin is not None:
                with contextlib.suppress(BrokenPipeError):
                    proc.stdin.close()
        self.progress.unlink(missing_ok=True)

    def go(self, on_go: Callable[[], None] | None = None) -> Results:
        """Start the clock and every worker; their figures once all have ended. The CPU of the
        control plane, and of the processes in `beside` (name → pid), is counted too. The rate
        runs to the last completion, or with `measure`, to the `measure`th of all."""
        reports = []
        # The control plane's CPU, sampled: what it used up to the last completion, not up to the
        # workers' exit (the agents leave once told that every task is done, a moment later).
        samples: list[tuple[float, dict[str, float]]] = []
        sampled = threading.Event()

        def sample() -> None:
            target, done_at = self.measure or self.tasks, math.inf
            while not sampled.wait(_SAMPLE_S):
                samples.append((time.time(), process_cpu_s(self.plane)))
                if target and done_at == math.inf and self.progress.stat().st_size >= target:
                    done_at = time.monotonic()
                if target and time.monotonic() >= done_at + self.linger_s:
                    self._say("stop")  # every task is done: the agents may leave
                    target = 0
        sampler = threading.Thread(target=sample, daemon=True)
        try:
            plane_before = process_cpu_s(self.plane)
            started = time.time()
            self._say("go")
            sampler.start()
            if on_go is not None:
                on_go()
            for proc in self.procs:
                assert proc.stdout is not None
                out = proc.stdout.read()  # not `communicate`: it would close stdin, which says stop
                proc.wait()
                reports.append(json.loads(out.strip().splitlines()[-1]))
            samples.append((time.time(), process_cpu_s(self.plane)))
        finally:
            sampled.set()
            if sampler.is_alive():
                sampler.join()  # before `kill` removes the progress file it reads
            self.kill()
        return self._results(reports, started, plane_before, samples)

    def _say(self, word: str) -> None:
        """A line to every worker's stdin."""
        for proc in self.procs:
            assert proc.stdin is not None
            # A worker gone: its report is missing below; a case over: its pipes are closed.
            with contextlib.suppress(BrokenPipeError, ValueError):
                proc.stdin.write(f"{word}\n")
                proc.stdin.flush()

    def _results(self, reports: list[Results], started: float, plane_before: dict[str, float],
                 samples: list[tuple[float, dict[str, float]]]) -> Results:
        mode, tasks, measure = self.mode, self.tasks, self.measure
        done = sum(r["done"] for r in reports)
        if mode != "idle" and done < tasks:
            raise RuntimeError(f"bench ({mode}): {done} of {tasks} tasks done")
        latencies = [x for r in reports for x in r["latencies"]]
        finished = sorted(t for r in reports for t in r["completions"])[measure - 1] if measure else \
            max(r["last"] for r in reports)
        done_by = measure or done
        plane_at = next(used for at, used in samples if at >= finished)
        used = {name: cpu - plane_before.get(name, 0.0) for name, cpu in plane_at.items()}
        split = [cpu_until(r["marks"], finished) for r in reports if r.get("marks")]
        used["workers"] = sum(s[0] for s in split) if split else sum(r.get("cpu_s", 0.0) for r in reports)
        main, in_requests = sum(s[1] for s in split), sum(s[2] for s in split)
        return {"rate": done_by / (finished - started) if done else 0.0, "done": done,
                # Where the CPU goes, per task: on 2 shared cores this bounds every rate.
                "cpu_ms_per_task": {name: 1000 * cpu / done_by for name, cpu in used.items()} if done else {},
                # The workers' share, split: their main threads (a worker's loop, an agent's claims
                # and completions) in their requests and outside them, and their other threads.
                "worker_ms_per_task": {"requests": 1000 * in_requests / done_by,
                                       "outside": 1000 * (main - in_requests) / done_by,
                                       "other threads": 1000 * (used["workers"] - main) / done_by}
                if split and done else {},
                "conflicts": sum(r["conflicts"] for r in reports), "rss_mb": max(r["rss_mb"] for r in reports),
                "member_told": sum(r.get("member_told", 0) for r in reports),
                "member_liveness": sum(r.get("member_liveness", 0) for r in reports),
                "sync_s": max(self.sync), "wakeups": [r.get("wakeups", 0) for r in reports],
                "cpu_s": [r.get("cpu_s", 0.0) for r in reports],
                "watch_events": sum(r.get("watch_events", 0) for r in reports), **percentiles(latencies)}


def run_workers(mode: str, kube: Kube, *, kubeconfig: Path, workers: int, tasks: int, max_tasks: int = 0,
                 seconds: float = 0.0, on_go: Callable[[], None] | None = None,
                 beside: dict[str, int] | None = None, measure: int = 0, linger_s: float = 0.0) -> Results:
    """One case: its workers started, then let go (`Workers`)."""
    return Workers(mode, kube, kubeconfig=kubeconfig, workers=workers, tasks=tasks, max_tasks=max_tasks,
                    seconds=seconds, beside=beside, measure=measure, linger_s=linger_s).go(on_go)




def side_by_side(kubeconfig: Path, modes: Sequence[str], *, workers: int, tasks: int,
                 operator_on: bool = False, queues: int = 1) -> dict[str, Results]:
    """The throughput cases of `modes` (floors, and "sdk": `tasks` tasks, `workers` workers),
    one after another, each in a namespace of its own (see the module). With `operator_on`,
    the SDK's namespace has the operator running, as by default. With `queues`, the tasks and
    the agents are spread over that many queues (`queue_of`): each agent claims from one, and
    watches that one only."""
    return {mode: _case(kubeconfig, mode, workers=workers, tasks=tasks, operator_on=operator_on, queues=queues)
            for mode in modes}


def _case(kubeconfig: Path, mode: str, *, workers: int, tasks: int, operator_on: bool, queues: int) -> Results:
    """One case of `side_by_side`: made ready, run, and its namespace gone."""
    with contextlib.ExitStack() as stack:
        kube = stack.enter_context(namespace(kubeconfig))
        beside: dict[str, int] = {}
        if mode in ("sdk", "protocol", "raw3", "objects3"):  # they claim Tasks, or write their status
            create_tasks(kube, tasks, queue="bench", queues=queues)
        if mode == "sdk" and operator_on:
            proc, port = operator(kube, kubeconfig)
            stack.callback(stop, proc)
            until(lambda: ready(port), 120, "the operator to be ready")
            beside["operator"] = proc.pid
        case = Workers(mode, kube, kubeconfig=kubeconfig, workers=workers, tasks=tasks, beside=beside, queues=queues)
        stack.callback(case.kill)
        settled = case.settle()
        return {**case.go(), "settle_s": round(settled, 2)}


def pairs(kubeconfig: Path, case: str, floor: str, *, count: int, workers: int, tasks: int,
          operator_on: bool = False, queues: int = 1) -> tuple[list[float], list[dict[str, Results]]]:
    """`count` pairs of `case` and `floor`, the order alternating: each pair's rate of `case`
    ÷ rate of `floor`, and the pairs' figures."""
    ratios, runs = [], []
    for i in range(count):
        order = (case, floor) if i % 2 == 0 else (floor, case)
        run = side_by_side(kubeconfig, order, workers=workers, tasks=tasks, operator_on=operator_on, queues=queues)
        ratios.append(run[case]["rate"] / run[floor]["rate"])
        runs.append(run)
    return ratios, runs


def ratio(per_pair: list[float]) -> float:
    """The figure of `pairs`' ratios: the median, over each two pairs in turn (one in each
    order), of their geometric mean. A pair's order can favour one case (the first follows its
    own setup, the second a run): a median of single pairs, with one order once more than the
    other, would lean that way. An odd last pair is left out, unless it is the only one."""
    couples = [math.sqrt(a * b) for a, b in zip(per_pair[::2], per_pair[1::2], strict=False)]
    return statistics.median(couples) if couples else per_pair[0]


def cpu_until(marks: list[list[float]], when: float) -> tuple[float, float, float]:
    """A worker's (process, main thread, main thread in requests) CPU seconds from its first
    mark to `when`, interpolated between the marks around it (see `worker.Meter`); the last
    mark's figures for a `when` past it."""
    first = marks[0]
    after = next((i for i, mark in enumerate(marks) if mark[0] >= when), len(marks) - 1)
    lo, hi = marks[max(after - 1, 0)], marks[after]
    share = 0.0 if hi[0] <= lo[0] else min(max((when - lo[0]) / (hi[0] - lo[0]), 0.0), 1.0)
    cpu, main, requests = (lo[k] + share * (hi[k] - lo[k]) - first[k] for k in (1, 2, 3))
    return cpu, main, requests

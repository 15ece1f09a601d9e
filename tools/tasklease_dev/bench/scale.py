"""The product at scale, operator on: agents starting together at a deep queue, and the drain of all of it.

Figures: each agent's start to its first claim, the agents' and the operator's peak memory,
the CPU both used, the drain rate.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tasklease.kube import Kube
from tasklease_dev.bench.procs import metric, operator, process_cpu_s, ready, status_mb, stop, until
from tasklease_dev.bench.space import create_tasks, namespace_config

Results = dict[str, Any]


def at_depth(kube: Kube, *, kubeconfig: Path, depth: int, agents: int) -> Results:
    """`depth` Tasks created (parallel raw writes) while the operator runs; once it has seen
    them all, `agents` agent processes start together and drain every one. The figures: each
    agent's start to its first claim, the agents' and the operator's peak memory (VmHWM), the
    drain rate from the first claim to the last completion, the CPU each side used, and the
    ramp: when each agent's list of the queue ended, and the completions minute by minute."""
    op, port = operator(kube, kubeconfig)
    try:
        until(lambda: ready(port), 120, "the operator to be ready")
        began = time.monotonic()
        create_tasks(kube, depth, queue="bench", kubeconfig=kubeconfig)
        created_s = time.monotonic() - began
        until(lambda: metric(port, "tasklease_tasks") >= depth, 3600, "the operator to see every task",
              interval=1.0)
        until(lambda: ready(port), 3600, "the operator to work through its backlog", interval=1.0)
        config = namespace_config(kube, kubeconfig)
        cpu_before = process_cpu_s({"operator": op.pid})["operator"]
        started = time.time()
        procs = [subprocess.Popen([sys.executable, "-m", "tasklease_dev.bench", "--worker", "first",
                                   "--kubeconfig", str(config), "--index", str(i)],
                                  stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
                 for i in range(agents)]
        reports = []
        try:
            for proc in procs:
                out, _ = proc.communicate(timeout=7200)
                reports.append(json.loads(out.strip().splitlines()[-1]))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        operator_cpu_s = process_cpu_s({"operator": op.pid})["operator"] - cpu_before
        operator_mb = status_mb(op.pid, "VmHWM")
    finally:
        stop(op)
    done = sum(r["done"] for r in reports)
    if done < depth:
        raise RuntimeError(f"bench: {done} of {depth} tasks done at depth {depth}")
    firsts = [r["first_claim"] - started for r in reports if r["first_claim"] is not None]
    first, last = min(r["first_claim"] for r in reports if r["first_claim"]), max(max(r["completions"]) for r in
                                                                               reports if r["completions"])
    return {"rate": done / (last - first), "done": done, "created_per_s": depth / created_s,
            "first_claim_max_s": max(firsts), "first_claim_median_s": statistics.median(firsts),
            "agents_without_a_claim": agents - len(firsts), "agent_rss_mb": max(r["rss_mb"] for r in reports),
            # Each agent's peak, how many of their lists of the queue the API server cut short
            # (each then listed again, in pages), and how many of those pages failed and were
            # asked for again.
            "agent_rss_mbs": sorted(r["rss_mb"] for r in reports),
            "agent_lists_cut_short": sum(r["lists_cut_short"] for r in reports),
            "agent_pages_retried": sum(r["pages_retried"] for r in reports),
            "operator_rss_mb": operator_mb, "drain_s": last - started,
            # How the drain ramps up: when each agent's list of the queue ended, and the tasks
            # completed in each minute, both from the agents' start.
            "agent_listed_s": sorted(r["listed"] - started for r in reports if r["listed"] is not None),
            "done_per_minute": per_minute([t - started for r in reports for t in r["completions"]]),
            "operator_cpu_s": operator_cpu_s, "agent_cpu_s": sum(r["cpu_s"] for r in reports)}


def per_minute(offsets: list[float]) -> list[int]:
    """How many of `offsets` (seconds, none negative) fall in each minute, the first to the last."""
    counts = [0] * (int(max(offsets, default=-60) // 60) + 1)
    for offset in offsets:
        counts[int(offset // 60)] += 1
    return counts

"""The `make bench` command: its options, its sections in order, the result file and the exit code.

Every figure is a ratio within one run on one control plane (the machine may be loaded), or a
time or size measured the same way:
- floors: one conditional PUT, a GET + PUT; peers: Python `LeaderElection`, client-go's
  `leaderelection` acquiring a free Lease;
- throughput, operator off: SDK agents at each --agents count over --tasks tasks, in pairs
  with raw Lease writes (claim + close) at the same concurrency;
- throughput, operator on: 8 and 16 agents drain --operator-tasks tasks with the operator
  running as by default, in pairs with a floor of the same three writes per task (Lease
  claim, Lease close, Task status write) and no watches; the watch events each agent got;
  and the same 16 agents and tasks spread over 8 queues (two agents a queue) and over 16 (one),
  `SPREADS`;
- the operator: writes per task and projection lag at 100 tasks/s; idle agents' wake-ups per
  renewal; recovery after SIGKILL (to the requeue, and to the next claim with a replacement of
  the same or a new pod name); cancel latency; etcd with and without fsync;
- depth: the one-shot claim (`tasklease claim`'s path, timed in one process, as the GET + PUT
  beside it) and the operator's memory at --cli-depth open tasks; the drain at --depth open ÷
  at --tasks open;
- scale, operator on: --scale tasks created by parallel raw writes, then 16 agents start
  together (on compiled bytecode, as in the image: `make bench` compiles it first): start to
  first claim, agents' and operator's peak memory, the drain ÷ 500 (the median of three
  drains of 500, two before and one after).
BENCH_QUICK=1 (or --quick) shrinks every size for a run of minutes; the targets at sizes it does
not reach are then "not run". The result file: bench/results/<date>-<commit>.json ($BENCH_OUT).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from tasklease_dev.bench import agents_at_work, floors, recovery, report, results, scale, worker
from tasklease_dev.bench.harness import pairs, ratio, side_by_side
from tasklease_dev.bench.procs import note
from tasklease_dev.bench.space import (OBJECTS_CASE, OBJECTS_FIGURE, OBJECTS_WORKERS, OPERATOR_ON_CASES, SPREADS,
                                       in_namespace, operator_on_case, operator_on_events, operator_on_figure)
from tasklease_dev.cluster import ClusterState, LocalCluster, stop_on_sigterm
from tasklease_dev.crds import apply_crds

Results = dict[str, Any]
SECTIONS = ("floors", "throughput", "operator-on", "objects", "operator", "recovery", "depth", "scale")
# The sizes of a default run, and of a quick one.
_SIZES = {"agents": ("1,4,8,16", "16"), "tasks": (500, 300), "pairs": (6, 2), "operator_tasks": (2000, 500),
          "depth": (30000, 3000), "cli_depth": (10000, 2000), "scale": (100000, 5000), "kills": (4, 2)}


def k(n: int) -> str:
    return f"{n // 1000}k" if n >= 1000 else str(n)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tasklease_dev.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    quick = os.environ.get("BENCH_QUICK", "") not in ("", "0")
    parser.add_argument("--quick", action="store_true", default=quick, help="every size small (BENCH_QUICK=1)")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"sections to run, of {','.join(SECTIONS)}")
    parser.add_argument("--agents", help="agent counts for the operator-off throughput cases (default 1,4,8,16)")
    parser.add_argument("--tasks", type=int, help="tasks per operator-off throughput case (default 500)")
    parser.add_argument("--pairs", type=int,
                        help="pairs per throughput ratio, order alternating, an even number (default 6)")
    parser.add_argument("--operator-tasks", type=int, help="tasks per operator-on throughput case (default 2000)")
    parser.add_argument("--depth", type=int, help="open tasks for the deep drain (default 30000)")
    parser.add_argument("--cli-depth", type=int, help="open tasks for the one-shot claim (default 10000)")
    parser.add_argument("--scale", type=int, help="tasks for the scale case (default 100000)")
    parser.add_argument("--kills", type=int, help="agents killed per recovery measurement (default 4)")
    parser.add_argument("--worker", choices=worker.MODES, help=argparse.SUPPRESS)
    parser.add_argument("--kubeconfig", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--max-tasks", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--queues", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=10.0, help=argparse.SUPPRESS)
    parser.add_argument("--progress", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker.run(args)))
        return 0
    for name, sizes in _SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, sizes[1] if args.quick else sizes[0])
    sections = args.only.split(",")
    if unknown := set(sections) - set(SECTIONS):
        parser.error(f"unknown sections: {', '.join(sorted(unknown))}")

    # A control plane of its own, fresh for each run and removed after it: what earlier work
    # left in etcd and in the API server's memory weighs on every figure, the deep drains most.
    bench_dir = Path.cwd() / ".cache" / "bench"
    cluster = LocalCluster(bench_dir / "cluster", bench_dir / "kubeconfig")
    cluster.down()
    stop_on_sigterm()
    try:
        return _bench(args, sections, cluster.up())
    finally:
        cluster.down()
        shutil.rmtree(bench_dir, ignore_errors=True)  # the namespaces' kubeconfigs too


def _bench(args: argparse.Namespace, sections: list[str], state: ClusterState) -> int:
    root = Path.cwd()
    began = time.monotonic()
    res, out = results.new(root, kubernetes=state.version, etcd_flags="--unsafe-no-fsync", quick=args.quick,
                           sections=sections, sizes={name: getattr(args, name) for name in _SIZES})
    kubeconfig = Path(state.kubeconfig)
    apply_crds(kubeconfig=kubeconfig, folder=root / "crds")
    note(f"tasklease bench on {res['machine']['cpu_model']} ({res['machine']['nproc']} CPUs, load "
         f"{res['machine']['loadavg_at_start']:.1f}), Kubernetes {state.version} on 127.0.0.1")
    space = functools.partial(in_namespace, kubeconfig)
    res["cases"] = {}

    def section(name: str, text: str) -> bool:
        """A section starts, if chosen: what is measured so far is on disk, whatever happens next."""
        if name not in sections:
            return False
        results.write(res, out)
        note(f"{name}: {text}")
        return True

    if section("floors", "one conditional PUT, GET + PUT; peers: Python LeaderElection, client-go"):
        res.update(space(floors.floors))
        res["python_le_p50_s"] = space(floors.python_le)
        res["client_go_p50_s"] = space(functools.partial(floors.client_go, kubeconfig=kubeconfig))
        res.update(space(floors.claims_beside_puts))
        res["claim_vs_put"] = res["claim_beside_put_p50_s"] / res["put_beside_claim_p50_s"]
        res["claim_vs_client_go"] = (res["claim_beside_put_p50_s"] / res["client_go_p50_s"]
                                     if res["client_go_p50_s"] else None)
        res["claim_vs_python_le"] = res["claim_beside_put_p50_s"] / res["python_le_p50_s"]
    counts = [int(n) for n in args.agents.split(",")]
    if section("throughput", f"operator off, {args.tasks} tasks, agents {args.agents}: the floors, then "
                             f"{args.pairs} pairs of the raw floor and the SDK"):
        raw, *nearer = worker.THROUGHPUT_FLOORS
        for n in counts:
            case = side_by_side(kubeconfig, nearer, workers=n, tasks=args.tasks)
            ratios, runs = pairs(kubeconfig, "sdk", raw, count=args.pairs, workers=n, tasks=args.tasks)
            res["cases"][str(n)] = {**case, **runs[0]}
            res["cases"][f"{n}-later-pairs"] = runs[1:]
            res[f"sdk_vs_floor_{n}_pairs"] = ratios
            res[f"sdk_vs_floor_{n}"] = ratio(ratios)
            for mode in nearer:
                res[f"{mode}_floor_vs_floor_{n}"] = case[mode]["rate"] / runs[0][raw]["rate"]
            res[f"conflicts_per_task_{n}"] = runs[0]["sdk"]["conflicts"] / args.tasks
    spreads = " and ".join(map(str, SPREADS))
    if section("operator-on", f"operator on, {args.operator_tasks} tasks, 8 and 16 agents on one queue, and 16 "
                              f"over {spreads} queues: {args.pairs} pairs each of the SDK and the 3-write floor"):
        events: dict[str, list[float]] = collections.defaultdict(list)  # by the figure's key
        for n, queues in OPERATOR_ON_CASES:
            ratios, runs = pairs(kubeconfig, "sdk", "raw3", count=args.pairs, workers=n, tasks=args.operator_tasks,
                                 operator_on=True, queues=queues)
            res["cases"][operator_on_case(n, queues)] = runs
            res[f"{operator_on_figure(n, queues)}_pairs"] = ratios
            res[operator_on_figure(n, queues)] = ratio(ratios)
            events[operator_on_events(queues)] += [run["sdk"]["watch_events"] / args.operator_tasks / n
                                                   for run in runs]
        for key, per_agent in events.items():
            res[key] = statistics.median(per_agent)
    if section("objects", f"{args.operator_tasks} tasks, {OBJECTS_WORKERS} workers: {args.pairs} pairs of the "
                          "3-write floor's writes made with the product's objects (the SDK's Leases, the "
                          "projected status) and the 3-write floor"):
        ratios, runs = pairs(kubeconfig, "objects3", "raw3", count=args.pairs, workers=OBJECTS_WORKERS,
                             tasks=args.operator_tasks)
        res["cases"][OBJECTS_CASE] = runs
        res[f"{OBJECTS_FIGURE}_pairs"] = ratios
        res[OBJECTS_FIGURE] = ratio(ratios)
    if section("operator", "idle agents beside renewals; the operator at 100 tasks/s"):
        res.update(space(functools.partial(agents_at_work.renewals, kubeconfig=kubeconfig)))
        res.update(space(functools.partial(agents_at_work.operator_flow, kubeconfig=kubeconfig)))
    if section("recovery", "SIGKILL to requeue, to the next claim; cancel; etcd fsync"):
        for key, fast in (("requeue_after_kill", False), ("requeue_after_pod_delete", True)):
            times = space(functools.partial(recovery.requeue_after_kill, kubeconfig=kubeconfig, kills=args.kills,
                                            pod_fast_path=fast))
            res[f"{key}_max_s"], res[f"{key}_median_s"] = max(times), statistics.median(times)
        for key, same in (("same_pod", True), ("new_pod", False)):
            times = space(functools.partial(recovery.reclaim_after_kill, kubeconfig=kubeconfig, kills=args.kills,
                                            same_pod=same))
            res[f"reclaim_after_kill_{key}_times_s"] = times
            res[f"reclaim_after_kill_{key}_max_s"] = max(times)
            res[f"reclaim_after_kill_{key}_median_s"] = statistics.median(times)
        res["reclaim_after_kill_max_s"] = max(res["reclaim_after_kill_same_pod_max_s"],
                                              res["reclaim_after_kill_new_pod_max_s"])
        times = space(functools.partial(recovery.cancel_to_holder, rounds=args.kills))
        res["cancel_to_holder_max_s"], res["cancel_to_holder_median_s"] = max(times), statistics.median(times)
        res.update(floors.etcd_fsync())
    if section("depth", f"one-shot claim at {args.cli_depth} open; drain at {args.tasks} then {args.depth} open"):
        res.update(space(functools.partial(agents_at_work.cli_and_operator_at_depth, kubeconfig=kubeconfig,
                                           depth=args.cli_depth, suffix=k(args.cli_depth))))
        # The two drains back to back: the same minutes weigh on both.
        shallow, deep = (space(functools.partial(agents_at_work.sdk_case, kubeconfig=kubeconfig, workers=8,
                                                 depth=depth, drain=args.tasks)) for depth in (args.tasks, args.depth))
        res[f"drain_{k(args.depth)}_vs_500"] = deep["rate"] / shallow["rate"]
        res["cases"][f"depth-{args.tasks}"], res["cases"][f"depth-{args.depth}"] = shallow, deep
        res[f"agent_rss_mb_{k(args.depth)}"], res[f"agent_sync_s_{k(args.depth)}"] = deep["rss_mb"], deep["sync_s"]
    if section("scale", f"operator on: 500 tasks (twice), {args.scale}, then 500 again, created; 16 agents start "
                        "together and drain each"):
        def drain(depth: int) -> dict[str, Any]:
            return space(functools.partial(scale.at_depth, kubeconfig=kubeconfig, depth=depth, agents=16))
        # A drain of 500 lasts a few seconds, so its rate swings more from run to run than a
        # drain of 100,000 does: it is the median of three, around the deep one.
        smalls = [drain(500), drain(500)]
        big = drain(args.scale)
        smalls.append(drain(500))
        small = sorted(smalls, key=lambda run: run["rate"])[1]
        suffix = k(args.scale)
        res["cases"]["scale-500"], res["cases"][f"scale-{args.scale}"] = small, big
        res["cases"]["scale-500-runs"] = smalls
        res[f"drain_{suffix}_vs_500"] = big["rate"] / small["rate"]
        res[f"agent_first_claim_{suffix}_s"] = big["first_claim_max_s"]
        res[f"agent_rss_mb_{suffix}"], res[f"operator_rss_mb_{suffix}"] = big["agent_rss_mb"], big["operator_rss_mb"]
        res["sizing"] = [{"tasks": depth, "agents": 16, "operator_rss_mb": got["operator_rss_mb"],
                          "operator_cpu_cores": got["operator_cpu_s"] / got["drain_s"],
                          "agent_rss_mb": got["agent_rss_mb"],
                          "agent_cpu_cores": got["agent_cpu_s"] / 16 / got["drain_s"]}
                         for depth, got in ((500, small), (args.scale, big))]
    res["runtime_s"] = time.monotonic() - began
    results.write(res, out)  # before the report: what was measured is kept, whatever the printing does
    missed = report.print_report(res)
    print(f"\nwritten to {out}")
    if res["quick"] or set(sections) != set(SECTIONS):
        return 1 if any(res.get(key) is not None for key in missed) else 0  # a partial run: judged on what ran
    return 1 if missed else 0

"""`make bench`: what tasklease costs at scale, beside floors and peers measured in the same run.

Every figure is a ratio within one run on one control plane (the machine may be loaded):
- floors: one conditional PUT (on an idle server, and paired with each claim of a warm
  agent at work), a GET + PUT, and raw Lease writes/s (create + PUT per task, shares known
  in advance: no discovery, no races) at the agents' concurrency, then two floors that
  show what watching every Lease costs: the same writes by workers that each watch every
  Lease, and the SDK's own Lease writes that way (`FLOORS`);
- peers: the official Python `LeaderElection` + `LeaseLock`, and client-go's
  `leaderelection` (built from the Go module proxy, QPS raised), acquiring a free Lease;
- tasklease: SDK agents (separate processes, as agents are separate pods) at 1/4/8/16
  agents over 500 tasks; the drain rate with 30,000 tasks open, beside the same drain with
  500 open run just before it; with `--full`, 100,000 tasks
  created and all drained by 16 agents with the operator on, beside 500 drained the same way;
  the one-shot claim with 10,000 open; the operator's writes per task and projection lag
  at 100 tasks/s, its memory and backlog at 10,000 tasks; idle agents' wake-ups per
  renewal of leases they do not hold; time to requeue after SIGKILL; how long a cancel
  takes to reach its holder; etcd with and without fsync.
Results are printed and written as JSON, with the machine, the commit and the date, to $BENCH_OUT
(default bench/results/<date>-<commit>.json, which docs/benchmarks.md is generated from).
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import contextlib
import functools
import json
import math
import os
import platform
import random
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from tasklease.agent.sdk import Agent, ClaimedTask, Identity
from tasklease.api import errors
from tasklease.api.timestamps import parse_time
from tasklease_dev import binaries
from tasklease_dev.cluster import ClusterState, LocalCluster, free_port, namespaced_kubeconfig, proc_stat
from tasklease_dev.crds import apply_crds
from tasklease_dev.dist import revision
from tasklease.kube import JSON, LEASES, NAMESPACES, PODS, TASKS, Kube
from tasklease.kube.watching import Reflector
from tasklease.protocol import Held, Protocol, TaskView, record

T = TypeVar("T")
Results = dict[str, Any]
PEERS = Path(__file__).parent / "peers"
_SAMPLE_S = 0.05  # how often a case reads the control plane's CPU

# figure, JSON key, target (text), whether the measured value meets it
TARGETS: list[tuple[str, str, str, Callable[[float], bool]]] = [
    ("SDK tasks/s ÷ floor at 8 agents", "sdk_vs_floor_8", "≥ 0.8", lambda v: v >= 0.8),
    ("SDK tasks/s ÷ floor at 16 agents", "sdk_vs_floor_16", "≥ 0.8", lambda v: v >= 0.8),
    ("409s per task at 16 agents", "conflicts_per_task_16", "≤ 0.05", lambda v: v <= 0.05),
    ("drain rate at 30k open ÷ at 500", "drain_30k_vs_500", "≥ 0.8", lambda v: v >= 0.8),
    ("wake-ups per renewal, idle agent", "renewal_wakeups_per_idle_agent", "≈ 0", lambda v: v <= 0.01),
    ("writes per task, operator on, happy path", "writes_per_task_operator", "≤ 3", lambda v: v <= 3),
    ("status projection lag p99 at 100 tasks/s (s)", "projection_lag_p99_s", "≤ 2", lambda v: v <= 2),
    ("operator RSS at 10k tasks (MB)", "operator_rss_mb_10k", "≤ 100", lambda v: v <= 100),
    ("operator RSS at 100k tasks (MB)", "operator_rss_mb_100k", "≤ 500", lambda v: v <= 500),
    ("agent RSS watching 100k (MB)", "agent_rss_mb_100k", "≤ 200", lambda v: v <= 200),
    ("drain of 100k ÷ of 500, operator on (--full)", "drain_100k_vs_500", "≥ 0.8", lambda v: v >= 0.8),
    ("`tasklease claim` p50 ÷ GET+PUT, 10k open", "cli_claim_vs_floor_10k", "≤ 3", lambda v: v <= 3),
    ("claim p50 ÷ one conditional PUT (warm, interleaved)", "claim_vs_put", "≤ 1.1", lambda v: v <= 1.1),
    ("claim p50 ÷ client-go acquire", "claim_vs_client_go", "-", lambda v: True),
    ("claim p50 ÷ Python LeaderElection acquire", "claim_vs_python_le", "-", lambda v: True),
    ("requeue after SIGKILL, max (s, lease 5 s)", "requeue_after_kill_max_s", "≤ 6", lambda v: v <= 6),
    ("requeue after holder Pod deleted, max (s)", "requeue_after_pod_delete_max_s", "≈ 0", lambda v: v <= 1),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tasklease_dev.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", default="1,4,8,16", help="agent counts for the throughput cases")
    parser.add_argument("--tasks", type=int, default=500, help="tasks per throughput case")
    parser.add_argument("--depth", type=int, default=30000, help="open tasks for the drain case")
    parser.add_argument("--cli-depth", type=int, default=10000, help="open tasks for the one-shot claim case")
    parser.add_argument("--full", nargs="?", type=int, const=100000, default=0, metavar="N",
                        help="also create N tasks (default 100,000) and drain them all with the operator on and "
                        "the most agents of --agents (adds 35-65 minutes on 2 cores)")
    parser.add_argument("--pairs", type=int, default=7,
                        help="SDK and raw floor cases run this many times at each agent count, in pairs "
                        "made ready together and run back to back (order alternating); SDK ÷ raw is the "
                        "median of the pairs' ratios")
    parser.add_argument("--kills", type=int, default=4, help="agents killed per recovery measurement")
    parser.add_argument("--worker", choices=[*FLOORS, "sdk", "idle"], help=argparse.SUPPRESS)
    parser.add_argument("--kubeconfig", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--max-tasks", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=10.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(args)))
        return 0

    # A control plane of its own, fresh for each run and removed after it: what earlier work
    # left in etcd and in the API server's memory weighs on every figure, the deep drains most.
    bench_dir = Path.cwd() / ".cache" / "bench"
    cluster = LocalCluster(bench_dir / "cluster", bench_dir / "kubeconfig")
    cluster.down()
    try:
        return _bench(args, cluster.up())
    finally:
        cluster.down()
        shutil.rmtree(bench_dir, ignore_errors=True)  # the namespaces' kubeconfigs too


def _bench(args: argparse.Namespace, state: ClusterState) -> int:
    root = Path.cwd()
    began = time.monotonic()
    res: Results = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": revision(root, short=True),
                    "machine": _machine(), "kubernetes": state.version, "etcd_flags": "--unsafe-no-fsync"}
    out = Path(os.environ.get("BENCH_OUT") or root / "bench" / "results" / f"{res['date'][:10]}-{res['commit']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    kubeconfig = Path(state.kubeconfig)
    apply_crds(kubeconfig=kubeconfig, folder=root / "crds")
    _note(f"tasklease bench on {res['machine']['cpu_model']} ({res['machine']['nproc']} CPUs), "
          f"Kubernetes {state.version} on 127.0.0.1")
    counts = [int(n) for n in args.agents.split(",")]

    def note(text: str) -> None:
        """A section starts: what is measured so far is on disk, whatever happens next."""
        out.write_text(json.dumps(res, indent=2, default=str) + "\n")
        _note(text)
    space = functools.partial(_in_namespace, kubeconfig)

    note("floors: one conditional PUT, GET + PUT")
    res.update(space(_floors))
    note("peers: Python LeaderElection, client-go leaderelection")
    res["python_le_p50_s"] = space(_python_le)
    res["client_go_p50_s"] = space(functools.partial(_client_go, kubeconfig=kubeconfig))
    res["cases"] = {}

    for n in counts:
        side_by_side = functools.partial(_side_by_side, kubeconfig, workers=n, tasks=args.tasks)
        # The raw floor last, just before the SDK: the first pair side by side too.
        order = (*FLOORS[1:], FLOORS[0])
        note(f"throughput at {n} agents: the floors ({', '.join(order)}), then the SDK ({args.tasks} tasks), "
             f"then {args.pairs - 1} more pairs of the raw floor and the SDK")
        case = side_by_side((*order, "sdk"))
        sdk = case["sdk"]
        res["cases"][n] = case
        # Even run back to back, one ratio of two rates is at the mercy of this machine's speed:
        # more pairs, the later ones in alternating order, and their median.
        ratios = [sdk["rate"] / case["raw"]["rate"]]
        res["cases"][f"{n}-later-pairs"] = later = []
        for i in range(args.pairs - 1):
            pair = side_by_side(("sdk", "raw") if i % 2 == 0 else ("raw", "sdk"))
            ratios.append(pair["sdk"]["rate"] / pair["raw"]["rate"])
            later.append(pair)
        res[f"sdk_vs_floor_pairs_{n}"] = ratios
        res[f"sdk_vs_floor_{n}"] = statistics.median(ratios)
        for mode in FLOORS[1:]:
            res[f"{mode}_floor_vs_floor_{n}"] = case[mode]["rate"] / case["raw"]["rate"]
        res[f"conflicts_per_task_{n}"] = sdk["conflicts"] / args.tasks
    first = res["cases"][counts[0]]["sdk"]
    res["claim_p50_s"] = first["p50"]
    res["claim_drain_vs_idle_put"] = first["p50"] / res["put_p50_s"]
    note("a warm agent's claims, each beside one conditional PUT")
    res.update(space(_claims_beside_puts))
    res["claim_vs_put"] = res["claim_beside_put_p50_s"] / res["put_beside_claim_p50_s"]
    res["claim_vs_get_put"] = first["p50"] / res["get_put_p50_s"]
    res["claim_vs_client_go"] = first["p50"] / res["client_go_p50_s"] if res["client_go_p50_s"] else None
    res["claim_vs_python_le"] = first["p50"] / res["python_le_p50_s"]

    note("renewals: idle agents beside 40 held, renewing leases")
    res.update(space(functools.partial(_renewals, kubeconfig=kubeconfig)))
    note("operator on: 1000 tasks at 100 tasks/s, 8 agents")
    res.update(space(functools.partial(_operator_flow, kubeconfig=kubeconfig)))
    note("recovery after SIGKILL: lease expiry, then the Pod-deletion fast path")
    for key, fast in (("requeue_after_kill", False), ("requeue_after_pod_delete", True)):
        times = space(functools.partial(_bench_recovery, kubeconfig=kubeconfig, kills=args.kills,
                                        pod_fast_path=fast))
        res[f"{key}_max_s"], res[f"{key}_median_s"] = max(times), statistics.median(times)
    note("cancel: spec.cancel set until its holder stops (lease 300 s)")
    times = space(functools.partial(_bench_cancel, rounds=args.kills))
    res["cancel_to_holder_max_s"], res["cancel_to_holder_median_s"] = max(times), statistics.median(times)
    note("etcd alone: sequential writes with and without fsync")
    res.update(_etcd_fsync())

    note(f"one-shot claim and operator memory at {args.cli_depth} open tasks")
    res.update(space(functools.partial(_cli_and_operator_at_depth, kubeconfig=kubeconfig, depth=args.cli_depth,
                                       suffix=_k(args.cli_depth))))
    drain_n = 8 if 8 in counts else counts[-1]
    # The two drains back to back, as the floors are interleaved: the same minutes weigh on both.
    note(f"drain of {args.tasks} with {args.tasks} open, then with {args.depth} open, {drain_n} agents")
    shallow, deep = (space(functools.partial(_sdk_case, kubeconfig=kubeconfig, workers=drain_n, depth=depth,
                                             drain=args.tasks)) for depth in (args.tasks, args.depth))
    res[f"drain_{_k(args.depth)}_vs_500"] = deep["rate"] / shallow["rate"]
    res["cases"][f"depth-{args.tasks}"] = shallow
    res[f"agent_rss_mb_{_k(args.depth)}"] = deep["rss_mb"]
    res[f"agent_sync_s_{_k(args.depth)}"] = deep["sync_s"]
    res["cases"][f"depth-{args.depth}"] = deep
    if args.full:
        note(f"{args.full} tasks drained by {counts[-1]} agents with the operator on (creating them first)")
        cases = {depth: space(functools.partial(_full_drain, kubeconfig=kubeconfig, depth=depth, agents=counts[-1]))
                 for depth in (args.tasks, args.full)}
        big, suffix = cases[args.full], _k(args.full)
        res[f"drain_{suffix}_vs_{_k(args.tasks)}"] = big["rate"] / cases[args.tasks]["rate"]
        res[f"agent_rss_mb_{suffix}"], res[f"operator_rss_mb_{suffix}"] = big["rss_mb"], big["operator_rss_mb"]
        res["cases"][f"full-{args.full}"], res["cases"][f"full-{args.tasks}"] = big, cases[args.tasks]
    res["runtime_s"] = time.monotonic() - began
    for _, key, _, _ in TARGETS:
        res.setdefault(key, None)  # every listed key, null when its case did not run
    _report(res, counts)
    out.write_text(json.dumps(res, indent=2, default=str) + "\n")
    print(f"\nwritten to {out}")
    return 0


# -- floors and peers -------------------------------------------------------------------------------


def _floor_lease(kube: Kube) -> JSON:
    """The bare Lease the PUT floors write: no labels, no owner, watched by nobody."""
    return kube.create(LEASES, {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                                "metadata": {"name": "floor"}, "spec": {"holderIdentity": "bench"}})


def _floors(kube: Kube, *, rounds: int = 200) -> Results:
    lease = _floor_lease(kube)
    put: list[float] = []
    get_put: list[float] = []
    for i in range(rounds):  # interleaved, so that a busy moment weighs on both alike
        lease["spec"]["leaseTransitions"] = 2 * i
        started = time.perf_counter()
        lease = kube.replace(LEASES, lease)
        put.append(time.perf_counter() - started)
        started = time.perf_counter()
        lease = kube.get(LEASES, "floor")
        lease["spec"]["leaseTransitions"] = 2 * i + 1
        lease = kube.replace(LEASES, lease)
        get_put.append(time.perf_counter() - started)
    return {"put_p50_s": statistics.median(put), "get_put_p50_s": statistics.median(get_put)}


def _claims_beside_puts(kube: Kube, *, rounds: int = 200) -> Results:
    """A warm agent works a queue (claim, complete, claim, ...) and each claim is paired with a
    conditional PUT, before it or after it in turn: the agent's own watch traffic and the API
    server's work for its last write weigh on both alike, which an idle PUT does not share."""
    _create_tasks(kube, rounds, queue="beside")
    lease = _floor_lease(kube)
    agent = Agent(kube, identity=Identity(pod="bench", instance="beside"))
    agent.watch("beside")
    claim = agent.protocol.claim
    puts: list[float] = []
    claims: list[float] = []

    def put() -> None:
        nonlocal lease
        lease["spec"]["leaseTransitions"] = len(puts)
        started = time.perf_counter()
        lease = kube.replace(LEASES, lease)
        puts.append(time.perf_counter() - started)

    def paired(*a: Any, **kw: Any) -> Held:
        first = len(claims) % 2 == 0
        if first:
            put()
        started = time.perf_counter()
        held = claim(*a, **kw)
        claims.append(time.perf_counter() - started)
        if not first:
            put()
        return held
    agent.protocol.claim = paired  # type: ignore[method-assign]
    try:
        agent.work("beside", lambda task: "ok", max_tasks=rounds, idle_timeout=10.0)
    finally:
        agent.close()
    return {"claim_beside_put_p50_s": statistics.median(claims), "put_beside_claim_p50_s": statistics.median(puts)}


def _python_le(kube: Kube, *, rounds: int = 20) -> float:
    """The official client's LeaderElection acquiring a free Lease (GET finds none, create)."""
    from kubernetes import client as k8s_client
    from kubernetes.leaderelection import electionconfig, leaderelection
    from kubernetes.leaderelection.resourcelock.leaselock import LeaseLock

    k8s_client.Configuration.set_default(kube.api_client.configuration)
    latencies = []
    for i in range(rounds):
        lock = LeaseLock(f"python-le-{i}", kube.namespace, "bench")  # type: ignore[no-untyped-call]
        config = electionconfig.Config(  # type: ignore[no-untyped-call]
            lock, lease_duration=15, renew_deadline=10, retry_period=2,
            onstarted_leading=lambda: None, onstopped_leading=lambda: None)
        election = leaderelection.LeaderElection(config)  # type: ignore[no-untyped-call]
        started = time.perf_counter()
        election.acquire()  # type: ignore[no-untyped-call]  # what run() does before leading
        latencies.append(time.perf_counter() - started)
    return statistics.median(latencies)


def _client_go(kube: Kube, *, kubeconfig: Path, rounds: int = 20) -> float | None:
    binary = _build_client_go()
    if binary is None:
        return None
    config = _namespace_config(kube, kubeconfig)
    done = subprocess.run([str(binary), str(config), kube.namespace, str(rounds)], capture_output=True, text=True,
                          timeout=300, check=True)
    return float(statistics.median(json.loads(done.stdout)["latencies"]))


def _build_client_go() -> Path | None:
    """Built once from `peers/` (client-go from the Go module proxy), cached beside the binaries."""
    go = shutil.which("go") or ("/usr/local/go/bin/go" if Path("/usr/local/go/bin/go").exists() else None)
    target = binaries.cache_root() / "peers" / "client-go-acquire"
    if target.exists() and target.stat().st_mtime >= (PEERS / "acquire.go").stat().st_mtime:
        return target
    if go is None:
        _note("no Go toolchain: the client-go peer is skipped")
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "GOFLAGS": "-mod=mod"}
    subprocess.run([go, "build", "-o", str(target), "."], cwd=PEERS, env=env, check=True, timeout=1800)
    return target


# -- agents as processes ----------------------------------------------------------------------------


def _sdk_case(kube: Kube, *, kubeconfig: Path, workers: int, depth: int, drain: int) -> Results:
    """`depth` open tasks, `workers` agents; the rate at which they drain `drain` of them.
    From a deeper queue, each agent takes twice its share and the rate runs to the `drain`th
    completion of all: a quota of exactly its share would make the rate wait for the
    slowest agent's last task, while the others, in a deep queue, would go on working."""
    _create_tasks(kube, depth, queue="bench")
    if drain >= depth:
        return _run_workers("sdk", kube, kubeconfig=kubeconfig, workers=workers, tasks=drain)
    return _run_workers("sdk", kube, kubeconfig=kubeconfig, workers=workers, tasks=drain,
                        max_tasks=math.ceil(2 * drain / workers), measure=drain)


class _Workers:
    """Worker processes started and ready (connected; an agent has joined its queue), each
    blocked on its stdin until `go`: one per worker, as agents are separate pods."""

    def __init__(self, mode: str, kube: Kube, *, kubeconfig: Path, workers: int, tasks: int, max_tasks: int = 0,
                 seconds: float = 0.0, beside: dict[str, int] | None = None, measure: int = 0) -> None:
        self.mode, self.tasks, self.measure = mode, tasks, measure
        config = _namespace_config(kube, kubeconfig)
        self.procs = [subprocess.Popen([sys.executable, "-m", "tasklease_dev.bench", "--worker", mode,
                                        "--kubeconfig", str(config), "--index", str(i), "--tasks", str(tasks),
                                        "--workers", str(workers), "--max-tasks", str(max_tasks),
                                        "--seconds", str(seconds)],
                                       stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True)
                      for i in range(workers)]
        self.plane = {**_control_plane(kubeconfig), **(beside or {})}
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

    def kill(self) -> None:
        """Ours: a worker left waiting for `go` would wait forever."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def go(self, on_go: Callable[[], None] | None = None) -> Results:
        """Start the clock and every worker; their figures once all have ended. The CPU of the
        control plane, and of the processes in `beside` (name → pid), is counted too. The rate
        runs to the last completion, or with `measure`, to the `measure`th of all."""
        reports = []
        # The control plane's CPU, sampled: what it used up to the last completion, not up to the
        # workers' exit (an agent waits `idle_timeout` for more work before it leaves).
        samples: list[tuple[float, dict[str, float]]] = []
        sampled = threading.Event()

        def sample() -> None:
            while not sampled.wait(_SAMPLE_S):
                samples.append((time.time(), _process_cpu_s(self.plane)))
        sampler = threading.Thread(target=sample, daemon=True)
        try:
            plane_before = _process_cpu_s(self.plane)
            started = time.time()
            for proc in self.procs:
                assert proc.stdin is not None
                with contextlib.suppress(BrokenPipeError):  # a worker gone: its report is missing below
                    proc.stdin.write("go\n")
                    proc.stdin.flush()
            sampler.start()
            if on_go is not None:
                on_go()
            for proc in self.procs:
                out, _ = proc.communicate(timeout=3600)
                reports.append(json.loads(out.strip().splitlines()[-1]))
            samples.append((time.time(), _process_cpu_s(self.plane)))
        finally:
            sampled.set()
            self.kill()
        return self._results(reports, started, plane_before, samples)

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
                "cpu_s": [r.get("cpu_s", 0.0) for r in reports], **_percentiles(latencies)}


def _run_workers(mode: str, kube: Kube, *, kubeconfig: Path, workers: int, tasks: int, max_tasks: int = 0,
                 seconds: float = 0.0, on_go: Callable[[], None] | None = None,
                 beside: dict[str, int] | None = None, measure: int = 0) -> Results:
    """One case: its workers started, then let go (`_Workers`)."""
    return _Workers(mode, kube, kubeconfig=kubeconfig, workers=workers, tasks=tasks, max_tasks=max_tasks,
                    seconds=seconds, beside=beside, measure=measure).go(on_go)


def _side_by_side(kubeconfig: Path, modes: Sequence[str], *, workers: int, tasks: int) -> dict[str, Results]:
    """The throughput cases of `modes` (floors, and "sdk": `tasks` tasks, `workers` workers),
    each in a namespace of its own, all made ready first, then run one right after another.
    A shared machine's speed changes from one minute to the next (the raw floor alone by a
    factor of several): a ratio of two rates is only as good as
    their closeness in time, and setting a case up (its tasks, its workers, deleting the last
    one's namespace) takes longer than running it."""
    with contextlib.ExitStack() as stack:
        ready: dict[str, _Workers] = {}
        for mode in modes:
            kube = stack.enter_context(_namespace(kubeconfig))
            if mode in ("sdk", "protocol"):  # they claim Tasks
                _create_tasks(kube, tasks, queue="bench")
            ready[mode] = _Workers(mode, kube, kubeconfig=kubeconfig, workers=workers, tasks=tasks)
            stack.callback(ready[mode].kill)
        return {mode: ready[mode].go() for mode in modes}


def cpu_until(marks: list[list[float]], when: float) -> tuple[float, float, float]:
    """A worker's (process, main thread, main thread in requests) CPU seconds from its first
    mark to `when`, interpolated between the marks around it (see `_Meter`); the last mark's
    figures for a `when` past it."""
    first = marks[0]
    after = next((i for i, mark in enumerate(marks) if mark[0] >= when), len(marks) - 1)
    lo, hi = marks[max(after - 1, 0)], marks[after]
    share = 0.0 if hi[0] <= lo[0] else min(max((when - lo[0]) / (hi[0] - lo[0]), 0.0), 1.0)
    cpu, main, requests = (lo[k] + share * (hi[k] - lo[k]) - first[k] for k in (1, 2, 3))
    return cpu, main, requests


class _Meter:
    """Where a worker's CPU goes, marked when its clock starts, at every task it completes and
    when it ends: (wall clock, process CPU, main thread CPU, main thread CPU in requests). The
    case reads them at its own end (`cpu_until`), which a worker does not know."""

    def __init__(self, kube: Kube) -> None:
        self.marks: list[tuple[float, float, float, float]] = []
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

    def mark(self) -> None:
        """On the main thread."""
        self.marks.append((time.time(), _cpu_s(), time.thread_time(), self._in_requests))


def _worker(args: argparse.Namespace) -> Results:
    kube = Kube.connect(kubeconfig=args.kubeconfig)
    meter = _Meter(kube)
    latencies: list[float] = []
    completions: list[float] = []  # when each task was completed (the SDK's)
    conflicts = done = 0
    last = time.time()
    report: Results = {}
    if args.worker in FLOORS:
        take, names, taken = _floor_writes(kube, args)
        print("ready 0", flush=True)
        _wait_for_go()
        cpu = _cpu_s()
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
        report = {"cpu_s": _cpu_s() - cpu}
    else:
        agent = Agent(kube, identity=Identity(pod=f"bench-{args.index}", instance=f"{os.getpid()}"))
        synced = time.monotonic()
        # A working agent is a member of its queue before the clock starts, as it would be at
        # work: joining (its member Lease written, and seen) is once per agent, not per task.
        view = agent.watch("bench") if args.worker == "idle" else agent.join("bench")
        print(f"ready {time.monotonic() - synced:.3f}", flush=True)
        _wait_for_go()
        if args.worker == "idle":
            wakeups, cpu = view.wakeups, _cpu_s()
            time.sleep(args.seconds)
            report = {"wakeups": view.wakeups - wakeups, "cpu_s": _cpu_s() - cpu}
        else:
            claim, complete = agent.protocol.claim, agent.protocol.complete

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
                return held
            agent.protocol.claim = timed_claim  # type: ignore[method-assign]
            agent.protocol.complete = timed_complete  # type: ignore[method-assign]
            cpu = _cpu_s()
            meter.mark()
            done = agent.work("bench", lambda task: "ok", idle_timeout=2.0, max_tasks=args.max_tasks or None)
            report = {"cpu_s": _cpu_s() - cpu}
        agent.close()
        writes = agent.member_writes()
        report.update(member_told=writes.told, member_liveness=writes.liveness)
    if meter.marks:
        meter.mark()
    rss_mb = _peak_rss_mb()
    return {"done": done, "latencies": latencies, "conflicts": conflicts, "last": last, "completions": completions,
            "rss_mb": rss_mb, "marks": meter.marks, **report}


# The floors: bare Lease writes, the shares known in advance ("raw"); the same writes by
# workers that each watch every Lease of the queue, as agents did before they watched only
# free Leases and their peers' member Leases (docs/protocol.md, Discovery), skip what they
# have seen taken and try the rest in an order of their own, a 409 meaning taken
# ("watched"); and the SDK's own Lease writes (`Protocol.claim`, `complete`: labels, owner,
# history) the same way ("protocol"). They show what every agent hearing of every claim
# costs, which the SDK no longer pays.
FLOORS = ("raw", "watched", "protocol")


Take = Callable[[str], Callable[[], Any]]  # takes a task (Conflict if another worker did); returns its letting go


def _floor_writes(kube: Kube, args: argparse.Namespace) -> tuple[Take, list[str], set[str]]:
    """How this floor worker takes a task, its tasks in its order, and the ones seen taken
    (kept current by its watch)."""
    taken: set[str] = set()
    if args.worker == "raw":  # no races: the floor
        names = [f"raw-{i:06d}" for i in range(args.index, args.tasks, args.workers)]
        return _bare_take(kube, args.index), names, taken
    watch = Reflector(kube, LEASES, namespace=kube.namespace, keep_objects=False,
                      listener=lambda kind, obj: taken.add(obj["metadata"]["name"]))
    watch.start()
    watch.synced.wait(60)
    if args.worker == "watched":
        take, names = _bare_take(kube, args.index), [f"raw-{i:06d}" for i in range(args.tasks)]
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


def _bare_take(kube: Kube, index: int) -> Take:
    def take(name: str) -> Callable[[], Any]:
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": name},
                "spec": {"holderIdentity": f"w{index}", "leaseDurationSeconds": 30, "leaseTransitions": 1}}
        created = kube.create(LEASES, body)
        created["spec"]["holderIdentity"] = None
        return lambda: kube.replace(LEASES, created)
    return take


def _peak_rss_mb() -> float:
    """This process's peak resident memory. Not `ru_maxrss`: Linux carries it over an exec
    from the forking process, so a worker would report the bench's own size (the bench
    holds what it created: 100,000 tasks' worth)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return math.nan


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _control_plane(kubeconfig: Path) -> dict[str, int]:
    """The bench's own control plane processes (the cluster beside its kubeconfig)."""
    state = LocalCluster(kubeconfig.parent / "cluster").running()
    return dict(state.pids) if state is not None else {}


def _process_cpu_s(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user + system) each process has used so far."""
    used = {}
    for name, pid in pids.items():
        try:
            fields = proc_stat(pid)
        except OSError:
            continue
        used[name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return used


def _wait_for_go() -> None:
    """A worker's start: a line on its stdin from `_Workers.go` (a blocked read costs no CPU
    while the cases before it run)."""
    sys.stdin.readline()


# -- renewals, the operator ---------------------------------------------------------------------------


def _renewals(kube: Kube, *, kubeconfig: Path, held: int = 40, idle: int = 4, seconds: float = 10.0) -> Results:
    """Idle agents beside `held` leases renewed every 5/3 s: how often does a renewal wake one?"""
    _create_tasks(kube, held, queue="bench", leaseDurationSeconds=5)
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
        window = _run_workers("idle", kube, kubeconfig=kubeconfig, workers=idle, tasks=0, seconds=seconds,
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


def _operator_flow(kube: Kube, *, kubeconfig: Path, tasks: int = 1000, rate: float = 100.0,
                   agents: int = 8) -> Results:
    """Tasks arrive at `rate`/s, `agents` drain them, the operator projects: writes and lag."""
    operator, port = _operator(kube, kubeconfig)
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
        _until(lambda: _get_ok(port), 120, "the operator to be ready")

        def produce() -> None:
            start = time.monotonic()
            for i in range(tasks):
                time.sleep(max(start + i / rate - time.monotonic(), 0))
                _create(kube, f"flow-{i:06d}", queue="bench")
        report = _run_workers("sdk", kube, kubeconfig=kubeconfig, workers=agents, tasks=tasks,
                              on_go=lambda: threading.Thread(target=produce, daemon=True).start())
        _until(lambda: len(succeeded) >= tasks, 300, "every task projected Succeeded")
        status_writes = _metric(port, "tasklease_status_writes_total", 'result="ok"')
        events = _metric(port, "tasklease_events_posted_total")
    finally:
        watch.stop()
        _stop(operator)
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
            "projection_lag_p50_s": statistics.median(lags), "projection_lag_p99_s": _p99(lags),
            "flow_conflicts_per_task": report["conflicts"] / tasks}


def _cli_and_operator_at_depth(kube: Kube, *, kubeconfig: Path, depth: int, suffix: str,
                               claims: int = 30) -> Results:
    """`depth` open tasks: the operator's memory and time to work through them as a backlog,
    then the one-shot claim (`tasklease claim`'s path) with the operator keeping up."""
    _create_tasks(kube, depth, queue="bench")
    started = time.monotonic()
    operator, port = _operator(kube, kubeconfig)
    try:
        _until(lambda: _get_ok(port), 3600, "the operator to work through its backlog", interval=1.0)
        backlog_s = time.monotonic() - started
        rss = _rss_mb(operator.pid)
        latencies = []
        agent = Agent(kube, identity=Identity(pod="cli", instance="bench"))
        for _ in range(claims):
            began = time.perf_counter()
            task = agent.claim_once("bench")
            latencies.append(time.perf_counter() - began)
            task.complete("ok")
            # As between two shell claims: the operator has projected the last one.
            _until(functools.partial(_phase_is, kube, task.name, "Succeeded"), 30, "the claimed task to be projected")
    finally:
        _stop(operator)
    out: Results = {f"operator_rss_mb_{suffix}": rss, f"operator_backlog_s_{suffix}": backlog_s}
    if latencies:
        out[f"cli_claim_p50_s_{suffix}"] = statistics.median(latencies)
        out[f"cli_claim_vs_floor_{suffix}"] = statistics.median(latencies) / _floors(kube, rounds=50)["get_put_p50_s"]
    return out


def _full_drain(kube: Kube, *, kubeconfig: Path, depth: int, agents: int) -> Results:
    """The whole product at scale: `depth` Tasks created while the operator runs, then
    `agents` agents drain every one of them while the operator works through its backlog
    and projects. The operator's memory is its peak, sampled every second."""
    operator, port = _operator(kube, kubeconfig)
    peak = [0.0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(1.0):
            peak[0] = max(peak[0], _rss_mb(operator.pid))
    threading.Thread(target=sample, daemon=True).start()
    try:
        _until(lambda: _get_ok(port), 120, "the operator to be ready")
        began = time.monotonic()
        _create_tasks(kube, depth, queue="bench")
        created_s = time.monotonic() - began
        drained = _run_workers("sdk", kube, kubeconfig=kubeconfig, workers=agents, tasks=depth,
                               beside={"operator": operator.pid})
        _until(lambda: _metric(port, "tasklease_tasks", 'phase="Succeeded"') >= depth, 3600,
               "every task projected Succeeded", interval=1.0)
        unfinished = sum(1 for page in kube.list_pages(TASKS, namespace=kube.namespace, limit=500)
                         for task in page.get("items", []) if (task.get("status") or {}).get("phase") != "Succeeded")
    finally:
        done.set()
        _stop(operator)
    if unfinished:
        raise RuntimeError(f"bench: {unfinished} of {depth} tasks not Succeeded after the drain")
    return {**drained, "created_per_s": depth / created_s, "operator_rss_mb": peak[0]}


def _operator(kube: Kube, kubeconfig: Path) -> tuple[subprocess.Popen[bytes], int]:
    config = _namespace_config(kube, kubeconfig)
    port = free_port()
    return _spawn(["operator", f"--kubeconfig={config}", f"--namespace={kube.namespace}", "--no-leader-elect",
                   "--grace=1", f"--http-port={port}", "--http-host=127.0.0.1"]), port


# -- recovery ---------------------------------------------------------------------------------------


def _bench_recovery(kube: Kube, *, kubeconfig: Path, kills: int, pod_fast_path: bool) -> list[float]:
    """Kill `kills` holders at once; seconds until each task is claimable again."""
    ns_config = _namespace_config(kube, kubeconfig)
    operator, port = _operator(kube, kubeconfig)
    agents = []
    try:
        for i in range(kills):
            pod = f"victim-{i}"
            kube.create(TASKS, {"apiVersion": "tasklease.dev/v1alpha1", "kind": "Task", "metadata": {"name": pod},
                                "spec": {"queue": pod, "leaseDurationSeconds": 5,
                                         "backoff": {"initialSeconds": 0, "maxSeconds": 0}}})
            if pod_fast_path:
                kube.create(PODS, {"apiVersion": "v1", "kind": "Pod",
                                   "metadata": {"name": pod, "labels": {"tasklease.dev/agent": "true"}},
                                   "spec": {"automountServiceAccountToken": False,
                                            "containers": [{"name": "a", "image": "agent:dev"}]}})
            # The command outlives its killed agent a little: short enough to end by itself.
            agents.append(_spawn(["run", f"--kubeconfig={ns_config}", "--queue", pod, "--", "sleep", "20"],
                                 env={"POD_NAME": pod}))
        _until(lambda: all(_state(kube, f"victim-{i}") == record.HELD for i in range(kills)), 60, "agents to claim")
        _until(lambda: _get_ok(port), 60, "the operator to be ready")
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
                if name not in freed and _state(kube, name) == record.FREE:
                    freed[name] = time.monotonic() - killed_at
            return len(freed) == kills
        _until(all_freed, 60, "every lease to be freed", interval=0.05)
        return list(freed.values())
    finally:
        for proc in [*agents, operator]:
            _stop(proc)


# -- etcd fsync ---------------------------------------------------------------------------------------


def _etcd_fsync(writes: int = 300) -> Results:
    """The local cluster runs etcd with --unsafe-no-fsync: sequential writes to a bare etcd
    with fsync on and off, on this disk, say what that changes."""
    out: Results = {}
    for name, flags in (("fsync_off", ["--unsafe-no-fsync"]), ("fsync_on", [])):
        data = Path(tempfile.mkdtemp(prefix="tasklease-bench-etcd-"))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen([str(binaries.ensure_kubernetes().etcd), f"--data-dir={data}",
                                 f"--listen-client-urls={url}", f"--advertise-client-urls={url}",
                                 f"--listen-peer-urls=http://127.0.0.1:{free_port()}", "--log-level=error", *flags],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _until(functools.partial(_http_ok, f"{url}/health"), 30, "etcd to start")
            latencies = []
            for i in range(writes):
                body = json.dumps({"key": base64.b64encode(f"k{i % 10}".encode()).decode(),
                                   "value": base64.b64encode(b"x" * 512).decode()}).encode()
                started = time.perf_counter()
                with urllib.request.urlopen(urllib.request.Request(f"{url}/v3/kv/put", data=body), timeout=10):
                    pass
                latencies.append(time.perf_counter() - started)
            out[f"etcd_put_p50_ms_{name}"] = statistics.median(latencies) * 1000
        finally:
            _stop(proc)
            shutil.rmtree(data, ignore_errors=True)
    out["etcd_fsync_on_vs_off"] = out["etcd_put_p50_ms_fsync_on"] / out["etcd_put_p50_ms_fsync_off"]
    return out


# -- report -------------------------------------------------------------------------------------------


def _report(res: Results, counts: list[int]) -> None:
    m = res["machine"]
    print(f"\ntasklease bench: {m['cpu_model']}, {m['nproc']} CPUs, Kubernetes {res['kubernetes']} on 127.0.0.1, "
          f"etcd {res['etcd_flags']}, {res['runtime_s'] / 60:.0f} min\n")
    modes = (*FLOORS, "sdk")
    print("tasks/s, and ÷ the raw floor, by agents: the floors one step nearer the SDK each (see FLOORS)")
    print(f"{'agents':>6} " + " ".join(f"{mode:>15}" for mode in modes) + f" {'claim p50':>10} {'claim p95':>10} "
          f"{'409s':>5}")
    for n in counts:
        case = res["cases"][n]
        print(f"{n:>6} " + " ".join(f"{case[m]['rate']:8.1f} ({case[m]['rate'] / case['raw']['rate']:4.2f})"
                                    for m in modes) +
              f" {_ms(case['sdk'].get('p50'))} {_ms(case['sdk'].get('p95'))} {case['sdk']['conflicts']:>5}")
    print("SDK ÷ raw, every pair (the first is the one above), and their median:")
    for n in counts:
        ratios = res[f"sdk_vs_floor_pairs_{n}"]
        print(f"{n:>6} " + " ".join(f"{r:4.2f}" for r in ratios) + f"  median {res[f'sdk_vs_floor_{n}']:.2f}")
    print(f"\nCPU per task (ms), {' → '.join(modes)}: who pays for a task on these shared cores")
    for n in counts:
        used = [res["cases"][n][m].get("cpu_ms_per_task", {}) for m in modes]
        shown = ", ".join(f"{name} " + " → ".join(f"{u.get(name, math.nan):.2f}" for u in used)
                          for name in sorted(set().union(*used)))
        print(f"{n:>6} agents: {shown}; all " + " → ".join(f"{sum(u.values()):.2f}" for u in used))
    print(f"the workers' share, {' → '.join(modes)}: their main threads in requests, outside them; their other threads")
    for n in counts:
        split = [res["cases"][n][m].get("worker_ms_per_task", {}) for m in modes]
        print(f"{n:>6} agents: " + ", ".join(f"{part} " + " → ".join(f"{s.get(part, math.nan):.2f}" for s in split)
                                            for part in ("requests", "outside", "other threads")))
    print(f"\nfloors: conditional PUT {_ms(res['put_p50_s'])}, GET + PUT {_ms(res['get_put_p50_s'])}; "
          f"peers acquiring a free Lease: Python LeaderElection {_ms(res['python_le_p50_s'])}, "
          f"client-go {_ms(res['client_go_p50_s'])}; SDK claim {_ms(res['claim_p50_s'])}")
    print(f"a warm agent's claim beside a conditional PUT, interleaved: claim {_ms(res['claim_beside_put_p50_s'])}, "
          f"PUT {_ms(res['put_beside_claim_p50_s'])}; the drain's claim ÷ the idle PUT "
          f"{res['claim_drain_vs_idle_put']:.2f}")
    print(f"etcd alone, sequential put p50: fsync off {res['etcd_put_p50_ms_fsync_off']:.2f} ms, "
          f"on {res['etcd_put_p50_ms_fsync_on']:.2f} ms ({res['etcd_fsync_on_vs_off']:.1f}x)")
    print(f"cancel reaching its holder: median {res['cancel_to_holder_median_s']:.3f} s, "
          f"max {res['cancel_to_holder_max_s']:.3f} s\n")
    print(f"{'figure':48} {'target':>8} {'measured':>10}")
    for figure, key, target, ok in TARGETS:
        value = res.get(key)
        shown = "not run" if value is None else f"{value:.3f}" if value < 10 else f"{value:.0f}"
        verdict = "" if value is None or target == "-" else ("  met" if ok(value) else "  NOT met")
        print(f"{figure:48} {target:>8} {shown:>10}{verdict}")


def _machine() -> Results:
    model = ""
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor()
    return {"nproc": os.cpu_count(), "cpu_model": model}


# -- helpers ------------------------------------------------------------------------------------------


def _bench_cancel(kube: Kube, *, rounds: int) -> list[float]:
    """From the cancel request to the holder's work being stopped (its `lost` event), with a
    lease of 300 s: without the holder's watch on its task this would wait for the renewal
    every 100 s. No operator runs: the holder hears it from the API server directly."""
    agent = Agent(kube)
    times = []
    try:
        for i in range(rounds):
            kube.create(TASKS, {"apiVersion": "tasklease.dev/v1alpha1", "kind": "Task",
                                "metadata": {"name": f"cancel-{i}"},
                                "spec": {"queue": "cancel", "leaseDurationSeconds": 300}})
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


@contextlib.contextmanager
def _namespace(kubeconfig: Path) -> Iterator[Kube]:
    """A client in a namespace of its own, deleted (and gone) afterwards."""
    admin = Kube.connect(kubeconfig=str(kubeconfig))
    name = f"bench-{uuid.uuid4().hex[:6]}"
    admin.create(NAMESPACES, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    try:
        yield Kube.connect(kubeconfig=str(kubeconfig), namespace=name, pool_size=64)
    finally:
        # Gone before the next case starts: deleting what a case made (30,000 Tasks, say)
        # costs the control plane about what making it did, and must not weigh on the next.
        began = time.monotonic()
        admin.delete(NAMESPACES, name)
        _until(lambda: admin.get_or_none(NAMESPACES, name) is None, 3600, f"namespace {name} to be deleted", 0.5)
        if time.monotonic() - began > 10:
            _note(f"namespace {name} and what the case made deleted in {time.monotonic() - began:.0f} s")


def _in_namespace(kubeconfig: Path, body: Callable[[Kube], T]) -> T:
    with _namespace(kubeconfig) as kube:
        return body(kube)


def _namespace_config(kube: Kube, kubeconfig: Path) -> Path:
    """A kubeconfig for `kube`'s namespace beside `kubeconfig` (removed with the bench's folder)."""
    return namespaced_kubeconfig(kubeconfig, kube.namespace, kubeconfig.parent / f"{kube.namespace}.kubeconfig")


def _create(kube: Kube, name: str, *, queue: str, **spec: Any) -> None:
    kube.create(TASKS, {"apiVersion": "tasklease.dev/v1alpha1", "kind": "Task", "metadata": {"name": name},
                        "spec": {"queue": queue, **spec}})


def _create_tasks(kube: Kube, count: int, *, queue: str, **spec: Any) -> None:
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: _create(kube, f"t-{i:06d}", queue=queue, **spec), range(count)))


def _percentiles(latencies: list[float]) -> dict[str, float]:
    if len(latencies) < 2:
        return {}
    q = statistics.quantiles(latencies, n=20)
    return {"p50": statistics.median(latencies), "p95": q[18]}


def _p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) >= 2 else (values[0] if values else math.nan)


def _ms(value: float | None) -> str:
    return f"{'-':>10}" if value is None else f"{value * 1000:8.2f}ms"


def _k(n: int) -> str:
    return f"{n // 1000}k" if n >= 1000 else str(n)


def _note(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def _phase_is(kube: Kube, name: str, phase: str) -> bool:
    return bool((kube.get(TASKS, name).get("status") or {}).get("phase") == phase)


def _state(kube: Kube, name: str) -> str:
    obj = kube.get_or_none(LEASES, name)
    return record.decode(obj).state if obj else ""


def _until(condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"bench: timed out waiting for {what}")
        time.sleep(interval)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def _get_ok(port: int) -> bool:
    return _http_ok(f"http://127.0.0.1:{port}/readyz")


def _metric(port: int, name: str, labels: str = "") -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if (line.startswith(name + "{") or line.startswith(name + " ")) and labels in line)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


def _spawn(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "tasklease.cli", *args], env={**os.environ, **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Only processes this bench started, by their own id."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait()


if __name__ == "__main__":
    raise SystemExit(main())

"""`make bench`: what tasklease costs and how fast it recovers, beside baselines from the same run.

Throughput (the same tasks, the same number of workers, no-op work):
- baseline `mv`: the file-based claiming users came from (seed study): an atomic rename
  per claim and per completion on a local disk. No expiry, no fencing, one machine.
- baseline raw Lease: the API server's floor: one create (claim) and one conditional PUT
  (complete) per task, each worker with its own share known in advance: no discovery, no
  races, no renewal.
- tasklease: the agent SDK (watch-based discovery, randomized choice, renewal threads).
Lease workers are separate processes, as agents are separate pods.

Cancel: how long a holder takes to hear that its task was cancelled.

Recovery: agents holding a task are killed with SIGKILL; time until each task is
claimable again, through lease expiry (the bound is lease duration + grace) beside the
Pod-deletion fast path.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from tasklease.api import errors
from tasklease.protocol import Held, record
from tasklease.agent.sdk import Agent, Identity
from tasklease.kube import LEASES, NAMESPACES, PODS, TASKS, Kube
from tasklease.dev.cluster import LocalCluster, free_port, namespaced_kubeconfig
from tasklease.dev.crds import apply_crds

T = TypeVar("T")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tasklease.dev.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--kills", type=int, default=4, help="agents killed per recovery measurement")
    parser.add_argument("--worker", choices=["raw", "sdk"], help=argparse.SUPPRESS)
    parser.add_argument("--kubeconfig", help=argparse.SUPPRESS)
    parser.add_argument("--go", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(args.worker, args.kubeconfig, args.go, args.index, args.tasks, args.workers)))
        return 0

    root = Path.cwd()
    state = LocalCluster(root / ".cache" / "cluster", root / ".cache" / "kubeconfig").up()
    kubeconfig = Path(state.kubeconfig)
    apply_crds(kubeconfig=kubeconfig, folder=root / "crds")
    print(f"tasklease bench: {args.tasks} tasks, {args.workers} workers, Kubernetes {state.version} on 127.0.0.1, "
          f"{os.cpu_count()} CPUs\n", flush=True)

    rows = [
        ("baseline: mv on a local disk", _bench_mv(args.tasks, args.workers)),
        ("baseline: raw Lease create + PUT", _in_namespace(kubeconfig, functools.partial(
            _bench_raw, kubeconfig=kubeconfig, args=args))),
        ("tasklease agent SDK", _in_namespace(kubeconfig, functools.partial(_bench_sdk, kubeconfig=kubeconfig,
                                                                             args=args))),
    ]
    print(f"{'throughput':40} {'tasks/s':>9} {'claim p50':>10} {'claim p95':>10} {'409s':>6}")
    for name, r in rows:
        print(f"{name:40} {r['rate']:9.1f} {_ms(r.get('p50'))} {_ms(r.get('p95'))} {r.get('conflicts', '-'):>6}")

    print(f"\n{'recovery after SIGKILL (lease 5 s, grace 1 s)':48} {'min':>6} {'median':>7} {'max':>6}")
    for name, pod_fast_path in (("lease expiry (operator observed time)", False), ("holder Pod deleted", True)):
        times = _in_namespace(kubeconfig, functools.partial(_bench_recovery, kubeconfig=kubeconfig,
                                                            kills=args.kills, pod_fast_path=pod_fast_path))
        print(f"{name:48} {min(times):5.1f}s {statistics.median(times):6.1f}s {max(times):5.1f}s")
    times = _in_namespace(kubeconfig, functools.partial(_bench_cancel, rounds=args.kills))
    print(f"\n{'cancel reaching the holder (lease 300 s)':48} {'min':>6} {'median':>7} {'max':>6}")
    print(f"{'spec.cancel set -> holder stops':48} {min(times):5.2f}s {statistics.median(times):6.2f}s "
          f"{max(times):5.2f}s")
    return 0


# -- throughput -------------------------------------------------------------------------------


def _bench_mv(tasks: int, workers: int) -> dict[str, float]:
    base = Path(tempfile.mkdtemp(prefix="tasklease-bench-mv-"))
    try:
        for sub in ("available", "claimed", "done"):
            (base / sub).mkdir()
        for i in range(tasks):
            (base / "available" / f"task-{i:04d}").write_text("{}")
        latencies: list[float] = []

        def worker(me: int) -> None:
            while True:
                names = sorted(os.listdir(base / "available"))
                if not names:
                    return
                for name in names:
                    started = time.perf_counter()
                    try:
                        os.rename(base / "available" / name, base / "claimed" / f"{name}.{me}")
                    except FileNotFoundError:
                        continue  # another worker's mv won
                    latencies.append(time.perf_counter() - started)
                    os.rename(base / "claimed" / f"{name}.{me}", base / "done" / name)
                    break

        elapsed = _threads(workers, worker)
        assert len(os.listdir(base / "done")) == tasks
        return {"rate": tasks / elapsed, **_percentiles(latencies)}
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _bench_raw(kube: Kube, *, kubeconfig: Path, args: argparse.Namespace) -> dict[str, float]:
    return _run_workers("raw", kube, kubeconfig, args)


def _bench_sdk(kube: Kube, *, kubeconfig: Path, args: argparse.Namespace) -> dict[str, float]:
    for i in range(args.tasks):
        kube.create(TASKS, {"apiVersion": "tasklease.dev/v1alpha1", "kind": "Task",
                            "metadata": {"name": f"sdk-{i:04d}"}, "spec": {"queue": "bench"}})
    return _run_workers("sdk", kube, kubeconfig, args)


def _run_workers(mode: str, kube: Kube, kubeconfig: Path, args: argparse.Namespace) -> dict[str, float]:
    """One process per worker, as agents are separate pods; the clock starts when all are ready."""
    config = namespaced_kubeconfig(kubeconfig, kube.namespace, kubeconfig.parent / f"{kube.namespace}.kubeconfig")
    go = kubeconfig.parent / f"{kube.namespace}.go"
    procs = [subprocess.Popen([sys.executable, "-m", "tasklease.dev.bench", "--worker", mode,
                               "--kubeconfig", str(config), "--go", str(go), "--index", str(i),
                               "--tasks", str(args.tasks), "--workers", str(args.workers)],
                              stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
             for i in range(args.workers)]
    for proc in procs:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"bench worker ({mode}) did not start")
    started = time.time()
    go.touch()
    reports = []
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        reports.append(json.loads(out.strip().splitlines()[-1]))
    go.unlink()
    done = sum(r["done"] for r in reports)
    if done != args.tasks:
        raise RuntimeError(f"bench ({mode}): {done} of {args.tasks} tasks done")
    latencies = [x for r in reports for x in r["latencies"]]
    finished = max(r["last"] for r in reports)
    return {"rate": args.tasks / (finished - started), "conflicts": sum(r["conflicts"] for r in reports),
            **_percentiles(latencies)}


def _worker(mode: str, kubeconfig: str, go: Path, index: int, tasks: int, workers: int) -> dict[str, object]:
    kube = Kube.connect(kubeconfig=kubeconfig)
    latencies: list[float] = []
    conflicts = 0
    done = 0
    if mode == "raw":
        names = [f"raw-{i:04d}" for i in range(index, tasks, workers)]  # no races: the floor
        print("ready", flush=True)
        _wait_for(go)
        for name in names:
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": name},
                    "spec": {"holderIdentity": f"w{index}", "leaseDurationSeconds": 30, "leaseTransitions": 1}}
            started = time.perf_counter()
            created = kube.create(LEASES, body)
            latencies.append(time.perf_counter() - started)
            created["spec"]["holderIdentity"] = None
            kube.replace(LEASES, created)
            done += 1
    else:
        agent = Agent(kube, identity=Identity(pod=f"bench-{index}", instance=f"{os.getpid()}"))
        agent.watch("bench")
        original = agent.protocol.claim

        def timed_claim(*a: object, **kw: object) -> Held:
            nonlocal conflicts
            started = time.perf_counter()
            try:
                held = original(*a, **kw)  # type: ignore[arg-type]
            except errors.Conflict:
                conflicts += 1
                raise
            latencies.append(time.perf_counter() - started)
            return held
        agent.protocol.claim = timed_claim  # type: ignore[method-assign]
        print("ready", flush=True)
        _wait_for(go)
        done = agent.work("bench", lambda task: "ok", idle_timeout=2.0)
        agent.close()
    last = time.time() - (2.0 if mode == "sdk" else 0.0)  # the idle wait that told us we were done
    return {"done": done, "latencies": latencies, "conflicts": conflicts, "last": last}


def _wait_for(path: Path) -> None:
    while not path.exists():
        time.sleep(0.005)


# -- recovery -------------------------------------------------------------------------------------


def _bench_recovery(kube: Kube, *, kubeconfig: Path, kills: int, pod_fast_path: bool) -> list[float]:
    """Kill `kills` holders at once; seconds until each task is claimable again."""
    ns_config = namespaced_kubeconfig(kubeconfig, kube.namespace, kubeconfig.parent / f"{kube.namespace}.kubeconfig")
    port = free_port()
    operator = _spawn(["operator", f"--kubeconfig={ns_config}", f"--namespace={kube.namespace}",
                       "--no-leader-elect", "--grace=1", f"--http-port={port}", "--http-host=127.0.0.1"])
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
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait()



# -- helpers ---------------------------------------------------------------------------------------


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


def _in_namespace(kubeconfig: Path, body: Callable[[Kube], T]) -> T:
    admin = Kube.connect(kubeconfig=str(kubeconfig))
    name = f"bench-{uuid.uuid4().hex[:6]}"
    admin.create(NAMESPACES, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    try:
        return body(Kube.connect(kubeconfig=str(kubeconfig), namespace=name, pool_size=64))
    finally:
        admin.delete(NAMESPACES, name)


def _threads(n: int, target: Callable[[int], None]) -> float:
    threads = [threading.Thread(target=target, args=(i,)) for i in range(n)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - started


def _percentiles(latencies: list[float]) -> dict[str, float]:
    if len(latencies) < 2:
        return {}
    q = statistics.quantiles(latencies, n=20)
    return {"p50": statistics.median(latencies), "p95": q[18]}


def _ms(value: float | None) -> str:
    return f"{'-':>10}" if value is None else f"{value * 1000:8.2f}ms"


def _state(kube: Kube, name: str) -> str:
    obj = kube.get_or_none(LEASES, name)
    return record.decode(obj).state if obj else ""


def _until(condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"bench: timed out waiting for {what}")
        time.sleep(interval)


def _get_ok(port: int) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def _spawn(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "tasklease.cli", *args], env={**os.environ, **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)


if __name__ == "__main__":
    raise SystemExit(main())

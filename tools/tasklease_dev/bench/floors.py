"""Floors and peers: a conditional PUT, a GET + PUT, a claim beside a PUT, leader election, etcd fsync.

The peers are the official Python `LeaderElection` and client-go's `leaderelection` (built
from the Go module proxy) acquiring a free Lease.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from tasklease.agent.sdk import Agent, Identity
from tasklease.kube import JSON, LEASES, Kube
from tasklease.protocol import Held
from tasklease_dev import binaries
from tasklease_dev.bench.procs import http_ok, note, stop, until
from tasklease_dev.bench.space import create_tasks, namespace_config
from tasklease_dev.cluster import free_port

Results = dict[str, Any]
PEERS = Path(__file__).parent.parent / "peers"


def floor_lease(kube: Kube) -> JSON:
    """The bare Lease the PUT floors write: no labels, no owner, watched by nobody."""
    return kube.create(LEASES, {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                                "metadata": {"name": "floor"}, "spec": {"holderIdentity": "bench"}})


def floors(kube: Kube, *, rounds: int = 200) -> Results:
    lease = floor_lease(kube)
    put: list[float] = []
    get_put: list[float] = []
    for i in range(rounds):  # interleaved, so that a busy moment weighs on both alike
        lease["spec"]["leaseTransitions"] = 2 * i
        started = time.perf_counter()
        lease = kube.replace(LEASES, lease)
        put.append(time.perf_counter() - started)
        lease, took = get_put_floor(kube, 2 * i + 1)
        get_put.append(took)
    return {"put_p50_s": statistics.median(put), "get_put_p50_s": statistics.median(get_put)}


def get_put_floor(kube: Kube, transitions: int) -> tuple[JSON, float]:
    """One GET + conditional PUT of the floor Lease (made by `floor_lease`): the Lease written
    and the seconds taken."""
    started = time.perf_counter()
    lease = kube.get(LEASES, "floor")
    lease["spec"]["leaseTransitions"] = transitions
    lease = kube.replace(LEASES, lease)
    return lease, time.perf_counter() - started


def claims_beside_puts(kube: Kube, *, rounds: int = 200) -> Results:
    """A warm agent works a queue (claim, complete, claim, ...) and each claim is paired with a
    conditional PUT, before it or after it in turn: the agent's own watch traffic and the API
    server's work for its last write weigh on both alike, which an idle PUT does not share."""
    create_tasks(kube, rounds, queue="beside")
    lease = floor_lease(kube)
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


def python_le(kube: Kube, *, rounds: int = 20) -> float:
    """The official client's LeaderElection acquiring a free Lease (GET finds none, create)."""
    from kubernetes import client as k8s_client
    from kubernetes.leaderelection import electionconfig, leaderelection
    from kubernetes.leaderelection.resourcelock.leaselock import LeaseLock

    k8s_client.Configuration.set_default(kube.connection.kubernetes_configuration())
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


def client_go(kube: Kube, *, kubeconfig: Path, rounds: int = 20) -> float | None:
    binary = _build_client_go()
    if binary is None:
        return None
    config = namespace_config(kube, kubeconfig)
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
        note("no Go toolchain: the client-go peer is skipped")
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "GOFLAGS": "-mod=mod"}
    subprocess.run([go, "build", "-o", str(target), "."], cwd=PEERS, env=env, check=True, timeout=1800)
    return target


def etcd_fsync(writes: int = 300) -> Results:
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
            health = f"{url}/health"
            until(functools.partial(http_ok, health), 30, "etcd to start")
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
            stop(proc)
            shutil.rmtree(data, ignore_errors=True)
    out["etcd_fsync_on_vs_off"] = out["etcd_put_p50_ms_fsync_on"] / out["etcd_put_p50_ms_fsync_off"]
    return out



"""Processes the bench starts and reads: the CLI and the operator, their memory, CPU and metrics.

Only processes this bench started are stopped, each by its own id.
"""

from __future__ import annotations

import math
import os
import resource
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from tasklease.kube import Kube
from tasklease_dev.bench.space import namespace_config
from tasklease_dev.cluster import LocalCluster, free_port, proc_stat


def note(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def until(condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"bench: timed out waiting for {what}")
        time.sleep(interval)


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def ready(port: int) -> bool:
    return http_ok(f"http://127.0.0.1:{port}/readyz")


def metric(port: int, name: str, labels: str = "") -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if (line.startswith(name + "{") or line.startswith(name + " ")) and labels in line)


def status_mb(pid: int | str, field: str) -> float:
    """A /proc/<pid>/status memory field in MB: VmRSS now, VmHWM the peak so far. Not
    `ru_maxrss`: Linux carries it over an exec from the forking process, so a worker would
    report the bench's own size."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return math.nan


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def process_cpu_s(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user + system) each process has used so far."""
    used = {}
    for name, pid in pids.items():
        try:
            fields = proc_stat(pid)
        except OSError:
            continue
        used[name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return used


def control_plane(kubeconfig: Path) -> dict[str, int]:
    """The bench's own control plane processes (the cluster beside its kubeconfig)."""
    state = LocalCluster(kubeconfig.parent / "cluster").running()
    return dict(state.pids) if state is not None else {}


def spawn(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`tasklease <args>` as a process of its own."""
    return subprocess.Popen([sys.executable, "-m", "tasklease.cli", *args], env={**os.environ, **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Only processes this bench started, by their own id."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait()


def operator(kube: Kube, kubeconfig: Path) -> tuple[subprocess.Popen[bytes], int]:
    """The operator for `kube`'s namespace as it runs by default (status projection and
    Events on), a grace of 1 s; its HTTP port."""
    config = namespace_config(kube, kubeconfig)
    port = free_port()
    return spawn(["operator", f"--kubeconfig={config}", f"--namespace={kube.namespace}", "--no-leader-elect",
                  "--grace=1", f"--http-port={port}", "--http-host=127.0.0.1"]), port

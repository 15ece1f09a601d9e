"""`tasklease top`: the summary, pure; then the live view read from a real terminal (tmux)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from conftest import Cluster, make_task, tasklease_cmd, wait_for
from tasklease.agent import Agent
from tasklease.cli import top
from tasklease.kube import Kube
from tasklease.protocol import record

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def _task(name: str, queue: str = "q", phase: str = "", reason: str = "", age_s: int = 60) -> dict[str, object]:
    created = (NOW - timedelta(seconds=age_s)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "creationTimestamp": created},
            "spec": {"queue": queue}, "status": {"phase": phase, "reason": reason} if phase else {}}


def _lease(name: str, **fields: object) -> record.LeaseRecord:
    return record.LeaseRecord(name=name, namespace="ns", queue="q", owner_uid=f"uid-{name}", **fields)  # type: ignore[arg-type]


def test_summary_counts_from_the_lease_first_then_the_status() -> None:
    tasks = [_task("new", age_s=300), _task("young", age_s=5), _task("backing"), _task("run1"), _task("run2"),
             _task("ok", phase="Succeeded"), _task("dead", phase="Failed", reason="DeadLettered"),
             _task("closed-not-projected"), _task("other", queue="z")]
    leases = {("ns", n): r for n, r in {
        "backing": _lease("backing", epoch=1, not_before=NOW + timedelta(seconds=30)),
        "run1": _lease("run1", epoch=1, holder="pod-a/1", acquired_at=NOW - timedelta(seconds=90)),
        "run2": _lease("run2", epoch=2, holder="pod-b/7", acquired_at=NOW - timedelta(seconds=10)),
        "closed-not-projected": _lease("closed-not-projected", epoch=1, outcome="Succeeded"),
    }.items()}
    rows = top.summarize(tasks, leases, NOW, claims=[("ns", "q")] * 5, completions=[("ns", "q")], window_s=10)
    q, z = rows
    assert (q.queue, q.pending, q.backing_off, q.running, q.succeeded, q.failed, q.dead_letters) == (
        "q", 3, 1, 2, 2, 1, 1)
    assert (q.claims_per_s, q.completions_per_s, q.oldest_pending_s) == (0.5, 0.1, 300)
    assert q.slowest == ("run1", 90) and q.holders == {"pod-a", "pod-b"}
    assert (z.queue, z.pending, z.claims_per_s) == ("z", 1, 0)
    text = top.render(rows, title="t")
    assert "run1 (1m)" in text and "pod-a,pod-b" in text and "5m" in text


class _Tmux:
    def __init__(self, socket: str) -> None:
        self.socket = socket

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, timeout=30,
                              check=check)

    def screen(self) -> str:
        return self("capture-pane", "-p", "-t", "top").stdout


def _line(screen: str, queue: str) -> list[str]:
    return next((line.split() for line in screen.splitlines() if f" {queue} " in f" {line} "), [])


@pytest.mark.skipif(shutil.which("tmux") is None,
                    reason="tmux is not installed (apt-get install -y tmux): `tasklease top` is read from its screen")
def test_top_in_a_terminal_shows_the_queue_live_and_quits_on_q(cluster: Cluster, kube: Kube, namespace: str,
                                                               tmp_path: Path) -> None:
    config = cluster.namespaced_kubeconfig(namespace, tmp_path)
    tmux = _Tmux(f"tasklease-{namespace}")
    command = f"env KUBECONFIG={shlex.quote(str(config))} {shlex.quote(sys.executable)} -m tasklease.cli top"
    tmux("new-session", "-d", "-s", "top", "-x", "220", "-y", "30", "sh")
    agent = Agent(kube)
    try:
        tmux("send-keys", "-t", "top", command, "Enter")  # typed at the shell's prompt, as a person would
        wait_for(lambda: "tasklease top" in tmux.screen(), message=f"top to draw; screen:\n{tmux.screen()}")
        for i in range(3):
            make_task(kube, f"t{i}", queue="live")
        # NAMESPACE QUEUE PENDING RUNNING BACKOFF SUCCEEDED FAILED DEAD ...
        wait_for(lambda: _line(tmux.screen(), "live")[3:5] == ["3", "0"], message="three pending")
        with agent.claim("live", timeout=30) as held:
            wait_for(lambda: _line(tmux.screen(), "live")[3:5] == ["2", "1"], message="one running")
            screen = tmux.screen()
            assert f"{held.name} (" in screen and agent.identity.pod in screen, screen
            held.complete("done")
        wait_for(lambda: _line(tmux.screen(), "live")[6] == "1", message="one succeeded")
        assert float(_line(tmux.screen(), "live")[10]) > 0  # completions per second, over the last 10 s
        tmux("send-keys", "-t", "top", "q")
        wait_for(lambda: "tasklease top -" not in tmux.screen(), message="top to quit on q and give the screen back")
        tmux("send-keys", "-t", "top", "echo exit=$?", "Enter")
        wait_for(lambda: "exit=0" in tmux.screen(), message="top's exit status")
    finally:
        agent.close()
        tmux("kill-server", check=False)


def test_top_once_across_all_namespaces(cluster: Cluster, kube: Kube, namespace: str) -> None:
    make_task(kube, "everywhere", queue="span")
    out = subprocess.run(tasklease_cmd("top", "-A", "--once"), capture_output=True, text=True, timeout=60,
                         env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig)})
    assert out.returncode == 0, out.stderr
    assert "tasklease top - all namespaces" in out.stdout
    assert [namespace, "span", "-", "1", "0"] == next(  # "-": no TaskQueue, no controls
        line.split()[:5] for line in out.stdout.splitlines() if line.startswith(namespace))

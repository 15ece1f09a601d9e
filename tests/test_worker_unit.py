"""agent.work's drain on SIGTERM, in a process of its own (the signal is process-wide), on the fake."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PROGRAM = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from tasklease.api.models import TaskSpec
    from tasklease.testing import FakeCluster

    cluster = FakeCluster()
    cluster.producer().submit_many([("first", TaskSpec(queue="q")), ("second", TaskSpec(queue="q"))])
    started = Path(sys.argv[1])

    def handler(task):
        started.touch()
        time.sleep(float(sys.argv[2]))  # the work goes on after SIGTERM, within the grace
        return "finished"

    with cluster.agent() as agent:
        done = agent.work("q", handler, grace_s=float(sys.argv[3]))
    print(done, *(t.status.phase.value for t in cluster.producer().list()))
""")


def _run(tmp_path: Path, work_s: float, grace_s: float) -> tuple[int, str]:
    started = tmp_path / "started"
    proc = subprocess.Popen([sys.executable, "-c", PROGRAM, str(started), str(work_s), str(grace_s)],
                            stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(300):
            if started.exists() or proc.poll() is not None:
                break
            subprocess.run(["sleep", "0.05"], check=True)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return proc.returncode, out.strip()


def test_sigterm_drains_the_work_loop_the_running_task_finishes_and_the_program_exits_0(tmp_path: Path) -> None:
    assert _run(tmp_path, work_s=0.5, grace_s=30) == (0, "1 Succeeded Pending")


def test_a_task_still_running_when_the_grace_runs_out_is_released(tmp_path: Path) -> None:
    assert _run(tmp_path, work_s=1.5, grace_s=0.2) == (0, "0 Pending Pending")


def test_importing_the_sdk_installs_no_signal_handler() -> None:
    check = ("import signal, tasklease.agent, tasklease.testing; "
             "assert all(signal.getsignal(s) is signal.SIG_DFL for s in (signal.SIGTERM, signal.SIGUSR1))")
    subprocess.run([sys.executable, "-c", check], check=True, timeout=60)

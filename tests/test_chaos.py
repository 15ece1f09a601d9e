"""The short variant of `make chaos`: every kind of fault at least once, every invariant checked."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tasklease.protocol import LeaseRecord
from tasklease_dev import chaos


def _write(name: str, holder: str) -> LeaseRecord:
    return LeaseRecord(name=name, namespace="chaos", queue="q", owner_uid="u", holder=holder, epoch=1)


@pytest.mark.unit
def test_kill_to_requeue_counts_only_the_leases_the_killed_agent_still_held() -> None:
    # agent-1 (pid 10) claimed a and b, closed b, and was killed at 100; a is expired at 106.
    # b, requeued later and claimed by agent-2 at 140, was no longer agent-1's when it died.
    writes = [(90.0, _write("a", "agent-1/10.1")), (91.0, _write("b", "agent-1/10.1")), (92.0, _write("b", "")),
              (106.0, _write("a", "")), (140.0, _write("b", "agent-2/20.1")), (150.0, _write("a", "agent-2/20.1"))]
    assert chaos.kill_to_requeue([(100.0, "agent-1/10.")], writes) == [6.0]
    # Restarted under the same pod name, another process: its writes are someone else's.
    assert chaos.kill_to_requeue([(100.0, "agent-1/10.")], [(90.0, _write("a", "agent-1/10.1")),
                                                            (101.0, _write("a", "agent-1/11.1"))]) == [1.0]
    assert chaos.kill_to_requeue([(100.0, "agent-3/30.")], writes) == []


@pytest.mark.skipif(bool(os.environ.get("TASKLEASE_KUBECONFIG")), reason="starts and kills its own control plane")
def test_a_short_chaos_run_keeps_every_promise(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = chaos.main(["--tasks", "60", "--poison", "3", "--agents", "3", "--work-s", "1", "--fault-every", "3",
                       "--timeout", "600", "--seed", "9", "--workdir", str(tmp_path / "chaos")])
    out = capsys.readouterr().out
    print(out[-3000:])
    assert code == 0, out[-3000:]
    assert "every invariant held" in out
    faults = out.split("faults: ")[-1].splitlines()[0]
    for kind in chaos.FAULTS:
        assert kind in faults, faults

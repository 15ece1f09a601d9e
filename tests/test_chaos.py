"""The short variant of `make chaos`: every kind of fault at least once, every invariant checked."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tasklease_dev import chaos


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

"""`tasklease run`'s Runner on tasklease.testing's fake: real commands, no control plane."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from conftest import wait_for
from tasklease.agent.runner import Runner, _payload_file
from tasklease.api import errors, models
from tasklease.api.models import TaskSpec
from tasklease.testing import FakeCluster

pytestmark = pytest.mark.unit


def _run(runner: Runner, *, loop: bool = False, wait_s: float | None = 0) -> list[int | BaseException]:
    """Run it off the main thread (it installs no signal handler there) and wait for it."""
    out: list[int | BaseException] = []

    def go() -> None:
        try:
            out.append(runner.run(loop=loop, wait_s=wait_s))
        except errors.TaskleaseError as exc:
            out.append(exc)
    thread = threading.Thread(target=go)
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    return out


def test_exit_0_completes_with_the_output_and_another_code_fails_with_stderr() -> None:
    cluster = FakeCluster()
    producer = cluster.producer()
    producer.submit("ok", TaskSpec(queue="q", payload={"n": 1}))
    with cluster.agent() as agent:
        assert _run(Runner(agent, queue="q", argv=["sh", "-c", 'echo "$TASKLEASE_TASK $(cat)"'])) == [0]  # type: ignore[arg-type]
        producer.submit("bad", TaskSpec(queue="q"))
        assert _run(Runner(agent, queue="q", argv=["sh", "-c", "echo nope >&2; exit 3"])) == [  # type: ignore[arg-type]
            errors.RUN_COMMAND_FAILED]
    assert producer.get("ok").status.result == 'ok {"n":1}'
    bad = producer.get("bad").status
    assert bad.phase is models.Phase.PENDING and "exited with code 3: nope" in bad.last_error


def test_a_cancel_stops_the_command(tmp_path: Path) -> None:
    cluster = FakeCluster()
    cluster.producer().submit("long", TaskSpec(queue="q"))
    started = tmp_path / "started"
    with cluster.agent() as agent:
        runner = Runner(agent, queue="q", argv=["sh", "-c", f"touch {started}; exec sleep 60"], grace_s=1)  # type: ignore[arg-type]
        threading.Thread(target=lambda: (wait_for(started.exists), cluster.producer().cancel("long")),
                         daemon=True).start()
        out = _run(runner)
    assert isinstance(out[0], errors.LostLease) and "cancelled" in str(out[0])


def test_concurrency_runs_commands_side_by_side(tmp_path: Path) -> None:
    cluster = FakeCluster()
    cluster.producer().submit_many([(f"t{i}", TaskSpec(queue="q")) for i in range(4)])
    # Each command waits until two are running at once: one at a time, none would finish.
    script = (f'touch {tmp_path}/$TASKLEASE_TASK; for i in $(seq 100); do '
              f'[ $(ls {tmp_path} | wc -l) -ge 2 ] && exit 0; sleep 0.05; done; exit 1')
    with cluster.agent() as agent:
        runner = Runner(agent, queue="q", argv=["sh", "-c", script], concurrency=2)  # type: ignore[arg-type]
        assert _run(runner, loop=True, wait_s=0.5) == [0]
    assert {t.status.phase for t in cluster.producer().list()} == {models.Phase.SUCCEEDED}


def test_a_drain_lets_the_running_command_finish_and_exits_0(tmp_path: Path) -> None:
    cluster = FakeCluster()
    cluster.producer().submit_many([("first", TaskSpec(queue="q")), ("second", TaskSpec(queue="q"))])
    started = tmp_path / "started"
    with cluster.agent() as agent:
        runner = Runner(agent, queue="q", argv=["sh", "-c", f"touch {started}; sleep 0.5; echo done"],  # type: ignore[arg-type]
                        drain=True, grace_s=20)
        threading.Thread(target=lambda: (wait_for(started.exists), runner.stop()), daemon=True).start()
        assert _run(runner, loop=True, wait_s=None) == [0]
    first, second = (cluster.producer().get(n).status for n in ("first", "second"))
    assert (first.phase, first.result) == (models.Phase.SUCCEEDED, "done")
    assert second.phase is models.Phase.PENDING and second.attempt == 0  # never claimed: the drain began


def test_the_payload_file_of_a_task_with_the_longest_name() -> None:
    with _payload_file('{"a": 1}', "t" * 253) as path:
        assert path is not None and Path(path).read_text() == '{"a": 1}'

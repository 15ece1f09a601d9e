"""The claimable-now gauges (`operator.claimable`): the rule with pinned times (backoff and a
delayed start end by the clock alone; held, closed and spent tasks never count; ages run
from the moment a task became claimable), then a real operator's gauge across a backoff."""

from __future__ import annotations

import os
import subprocess
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from conftest import Cluster, Operator, make_task, tasklease_cmd, wait_for
from tasklease.api import models, timestamps
from tasklease.kube import TASKS
from tasklease.operator.claimable import Waits, claimable_by_waiting, waits_end
from tasklease.protocol import LeaseRecord, TaskView

T0 = datetime(2030, 1, 1, tzinfo=UTC)
WHERE = ("shop", "emails")


def _view(name: str = "t", **spec: object) -> TaskView:
    return TaskView(name=name, namespace="shop", uid=f"uid-{name}", spec=models.TaskSpec(queue="emails", **spec),
                    created="2030-01-01T00:00:00Z")


def _lease(name: str = "t", *, version: str = "1", **fields: object) -> LeaseRecord:
    return LeaseRecord(name=name, namespace="shop", queue="emails", owner_uid=f"uid-{name}", epoch=1,
                       resource_version=version, **fields)  # type: ignore[arg-type]


def _at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_waits_end_with_backoff_or_a_delayed_start_and_do_not_help_what_waiting_cannot_end() -> None:
    assert waits_end(_view(), None) is None
    assert waits_end(_view(not_before=_at(60)), _lease(not_before=_at(30))) == _at(60)
    assert waits_end(_view(), _lease(not_before=_at(30))) == _at(30)
    assert claimable_by_waiting(_view(not_before=_at(60)), None, _at(5))
    assert claimable_by_waiting(_view(), _lease(not_before=_at(30)), _at(5))
    assert not claimable_by_waiting(_view(), _lease(holder="pod/1"), _at(5))
    assert not claimable_by_waiting(_view(), _lease(outcome="Succeeded"), _at(5))
    assert not claimable_by_waiting(_view(max_attempts=1), _lease(), _at(5))  # its one attempt is spent
    assert not claimable_by_waiting(_view(cancel=True), None, _at(5))
    assert not claimable_by_waiting(_view(deadline=_at(20)), _lease(not_before=_at(30)), _at(5))  # too late then


def test_per_queue_counts_only_tasks_claimable_at_that_moment_and_ages_them_from_then() -> None:
    waits: Waits[str] = Waits()
    created = "2030-01-01T00:00:00Z"
    waits.note("fresh", _view("fresh"), None, pending=True, now=_at(1))  # nothing to keep: claimable since creation
    waits.note("later", _view("later", not_before=_at(100)), None, pending=True, now=_at(1))
    waits.note("backoff", _view("backoff"), _lease("backoff", not_before=_at(50)), pending=True, now=_at(20))
    waits.note("released", _view("released"), _lease("released"), pending=True, now=_at(30))
    waits.note("held", _view("held"), _lease("held", holder="pod/1"), pending=True, now=_at(1))
    pending = [(k, WHERE, created) for k in ("fresh", "later", "backoff", "released", "held")]
    other = ("shop", "idle")

    def at(seconds: float) -> tuple[int, float]:
        rows = waits.per_queue([WHERE, other], pending, _at(seconds))
        assert ("shop", "idle", 0, 0.0) in rows
        return next((n, age) for ns, q, n, age in rows if (ns, q) == WHERE)
    assert at(40) == (2, 40.0)  # fresh (40 s old) and released (claimable since we saw it end, 10 s)
    assert at(50) == (3, 50.0)  # the backoff just ended
    assert at(110) == (4, 110.0)

    # Seeing the same Lease version again keeps when it ended; a new version starts again.
    waits.note("released", _view("released"), _lease("released"), pending=True, now=_at(45))
    assert waits.per_queue([WHERE], [("released", WHERE, created)], _at(50)) == [("shop", "emails", 1, 20.0)]
    waits.note("released", _view("released"), _lease("released", version="2"), pending=True, now=_at(45))
    assert waits.per_queue([WHERE], [("released", WHERE, created)], _at(50)) == [("shop", "emails", 1, 5.0)]
    # No longer Pending, or gone: forgotten.
    waits.note("backoff", _view("backoff"), _lease("backoff", holder="pod/2"), pending=False, now=_at(60))
    waits.forget("later")
    assert waits._by_key.keys() == {"released", "held"}


def test_a_task_backing_off_is_pending_but_claimable_only_once_its_backoff_ends(
        cluster: Cluster, namespace: str, operator: Operator, tmp_path: Path) -> None:
    kube = cluster.kube(namespace)
    make_task(kube, "flaky", queue="flaky", backoff={"initialSeconds": 10, "maxSeconds": 10, "jitter": False})
    where = f'namespace="{namespace}",queue="flaky"'

    def value(series: str) -> float | None:
        for line in operator.get("/metrics")[1].splitlines():
            if line.startswith(series + " "):
                return float(line.rsplit(" ", 1)[1])
        return None
    wait_for(lambda: value(f"tasklease_claimable_tasks{{{where}}}") == 1.0, message="the new task claimable")
    config = cluster.namespaced_kubeconfig(namespace, tmp_path)
    ran = subprocess.run(tasklease_cmd("run", "--queue", "flaky", "--", "false"), capture_output=True, text=True,
                         timeout=60, env={**os.environ, "KUBECONFIG": str(config)})
    assert ran.returncode != 0
    failed_at = time.monotonic()
    pending = f'tasklease_tasks{{namespace="{namespace}",phase="Pending",queue="flaky"}}'
    wait_for(lambda: value(pending) == 1.0 and value(f"tasklease_claimable_tasks{{{where}}}") == 0.0,
             message="pending, backing off, not claimable")
    assert time.monotonic() - failed_at < 10, "the backoff ended before the check: the machine is too slow"
    # The status projection is written after the operator's picture changes: wait for it.
    status = wait_for(lambda: (s := kube.get(TASKS, "flaky")["status"]).get("reason") == "BackingOff" and s,
                      message="the status to say BackingOff")
    backoff_end = timestamps.parse_time(status["notBefore"])
    wait_for(lambda: value(f"tasklease_claimable_tasks{{{where}}}") == 1.0, timeout=30,
             message="claimable once the backoff ended")
    assert backoff_end is not None and datetime.now(UTC) >= backoff_end  # the operator and we share a clock
    assert 0 <= value(f"tasklease_oldest_claimable_seconds{{{where}}}") < 5  # type: ignore[operator]

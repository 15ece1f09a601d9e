"""Jitter in the task backoff: bounded, drawn from an injected random source, and spread."""

from __future__ import annotations

import pytest

import random
from datetime import UTC, datetime, timedelta

from tasklease.api import models
from tasklease.protocol import record
from tasklease.protocol.rules import TaskView, claimed, requeued

pytestmark = pytest.mark.unit  # pure logic: `make unit` runs it, on every Python

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def _task(name: str, **backoff: object) -> TaskView:
    spec = models.TaskSpec.model_validate({"queue": "q",
                                           "backoff": {"initialSeconds": 8, "maxSeconds": 300, **backoff}})
    return TaskView(name=name, namespace="ns", uid=f"uid-{name}", spec=spec, created="2026-01-01T00:00:00Z")


def test_the_jittered_delay_lies_between_half_the_delay_and_the_whole_of_it() -> None:
    backoff = models.Backoff(initial_seconds=8, max_seconds=300)
    assert backoff.jitter  # on by default
    assert [backoff.jittered(3, lambda r=r: r) for r in (0.0, 0.5, 0.999)] == [16.0, 24.0, 31.984]
    assert models.Backoff(initial_seconds=8, max_seconds=20).jittered(9, lambda: 0.0) == 10.0  # capped first
    assert models.Backoff(initial_seconds=8, jitter=False).jittered(3, lambda: 0.0) == 32.0
    fixed = models.Backoff(policy=models.BackoffPolicy.FIXED, initial_seconds=8)
    assert [fixed.jittered(5, lambda r=r: r) for r in (0.0, 0.5)] == [4.0, 6.0]  # Fixed is jittered the same way


def test_tasks_failed_together_come_back_spread_over_the_jitter_window_not_together() -> None:
    rand = random.Random(34).random  # pinned: the same spread on every run
    returns = []
    for i in range(100):
        task = _task(f"t{i}")
        rec = requeued(claimed(task, None, "pod/1", NOW), task.spec, outcome="Expired", message="outage", now=NOW,
                       backoff=True, rand=rand)
        assert rec.state == record.FREE and rec.not_before is not None
        returns.append((rec.not_before - NOW).total_seconds())
    assert all(4 <= r <= 8 for r in returns)  # attempt 1: initialSeconds 8, halved at most
    assert len({round(r, 3) for r in returns}) > 90  # no crowd at one moment
    per_second = [sum(1 for r in returns if 4 + s <= r < 5 + s) for s in range(4)]
    assert max(per_second) < 40, per_second  # about a quarter in each second of the window


def test_without_jitter_tasks_failed_together_return_together() -> None:
    ends = {requeued(claimed(task, None, "pod/1", NOW), task.spec, outcome="Expired", message="", now=NOW,
                     backoff=True, rand=random.Random(i).random).not_before
            for i, task in enumerate(_task(f"t{i}", jitter=False) for i in range(10))}
    assert ends == {NOW + timedelta(seconds=8)}

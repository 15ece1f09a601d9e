"""The operator's TaskQueue controller without a control plane: which changes become Events,
and which claims break the rate (an injected monotonic clock, a fake Kube)."""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from typing import Any

import pytest

pytest.importorskip("prometheus_client")  # the operator's extra: not on the SDK-only Pythons of `make unit-all`

from fake_kube import FakeKube  # noqa: E402
from tasklease.operator.queues import QueueController, rate_allowance  # noqa: E402
from tasklease.protocol import record  # noqa: E402

pytestmark = pytest.mark.unit

NOW = datetime(2026, 1, 1, tzinfo=UTC)


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _controller(clock: _Clock) -> QueueController:
    kube: Any = FakeKube()
    return QueueController(kube, claimable=lambda: [], active=threading.Event(), monotonic=clock, clock=lambda: NOW)


def _taskqueue(generation: int, observed: int, **spec: object) -> dict[str, object]:
    return {"metadata": {"name": "q", "namespace": "ns", "uid": "u1", "generation": generation,
                         "resourceVersion": str(generation)}, "spec": spec,
            "status": {"observedGeneration": observed}}


def _held(name: str) -> dict[str, object]:
    return {"metadata": {"name": name, "namespace": "ns", "resourceVersion": "1",
                         "labels": {"tasklease.dev/queue": "q"}},
            "spec": {"holderIdentity": "rogue/1", "leaseTransitions": 1}}


def test_pause_and_resume_become_events_once() -> None:
    ctl = _controller(_Clock())
    ctl.on_queue("ADDED", _taskqueue(1, 1))
    ctl.on_queue("MODIFIED", _taskqueue(2, 1, paused=True))
    ctl.on_queue("MODIFIED", _taskqueue(2, 2, paused=True))  # our own status write: no news
    ctl.on_queue("MODIFIED", _taskqueue(3, 2, paused=False))
    assert [reason for _, reason, _ in ctl._queues[("ns", "q")].news] == ["Paused", "Resumed"]
    restarted = _controller(_Clock())
    restarted.on_queue("ADDED", _taskqueue(2, 2, paused=True))  # an operator restart: already answered
    assert restarted._queues[("ns", "q")].news == []


def test_claims_beyond_the_rate_are_taken_back_newest_first() -> None:
    clock = _Clock()
    ctl = _controller(clock)
    ctl.on_queue("ADDED", _taskqueue(1, 1, claimsPerSecond=1.0))
    undone: list[str] = []
    ctl._undo = lambda q, key, h, why: undone.append(key[1])  # type: ignore[method-assign]
    allowed = rate_allowance(1.0)
    for i in range(allowed + 3):
        ctl.on_lease("ADDED", record.read(_held(f"t{i:02d}")))
    q = ctl._queues[("ns", "q")]
    ctl._police_rate(q, ("ns", "q"), 1.0, clock.t)
    assert undone == [f"t{i:02d}" for i in range(allowed + 2, allowed - 1, -1)]
    ctl._police_rate(q, ("ns", "q"), 1.0, clock.t)
    assert len(undone) == 3  # each claim judged once


def test_the_rate_allowance_covers_an_honest_fleet_at_any_rate() -> None:
    assert rate_allowance(1.0) == 12 + 1 + 1  # 12 s of claims (window and watch delay), the burst, the edge
    assert rate_allowance(0.1) == 1 + 1 + 1  # a slow rate's burst is still one claim


def test_the_first_list_is_no_news_of_claims() -> None:
    ctl = QueueController(FakeKube(), claimable=lambda: [], active=threading.Event(),  # type: ignore[arg-type]
                          monotonic=_Clock(), clock=lambda: NOW, synced=lambda: False)
    ctl.on_queue("ADDED", _taskqueue(1, 1, claimsPerSecond=0.1))
    for i in range(10):
        ctl.on_lease("ADDED", record.read(_held(f"old-{i}")))
    assert not ctl._claims.get(("ns", "q")) and not any(h.news for h in ctl._held.values())

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
from tasklease.protocol import record, slots  # noqa: E402
from tasklease.protocol.slots import Slot  # noqa: E402

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


def _held(name: str, queue: str = "q", version: str = "1") -> dict[str, object]:
    return {"metadata": {"name": name, "namespace": "ns", "resourceVersion": version,
                         "labels": {"tasklease.dev/queue": queue}},
            "spec": {"holderIdentity": "rogue/1", "leaseTransitions": 1}}


def _slot(index: int, holder: str = "rogue/1") -> Slot:
    return Slot(name=f"tasklease-slot.q.{index}", namespace="ns", queue="q", index=index, holder=holder, version="1")


def _uncovered(ctl: QueueController, queue_slots: list[Slot]) -> list[str]:
    """The claims `_police_limit` takes back once they have been uncovered for `slots.STALE_S`."""
    undone: list[str] = []
    ctl._undo = lambda q, key, h, why: undone.append(key[1])  # type: ignore[method-assign]
    ctl.kube.list = lambda *a, **kw: {"items": []}  # type: ignore[attr-defined]  # the fresh read: no slot
    q = ctl._queues[("ns", "q")]
    held = dict(ctl._held)
    ctl._police_limit(q, ("ns", "q"), held, [(s, 0.0) for s in queue_slots], ctl.monotonic())
    ctl.monotonic.t += slots.STALE_S  # type: ignore[attr-defined]
    fresh = [{"metadata": {"name": s.name, "namespace": "ns", "resourceVersion": "1",
                           "labels": {slots.LABEL_SLOT_OF: "q"}}, "spec": {"holderIdentity": s.holder}}
             for s in queue_slots]
    ctl.kube.list = lambda *a, **kw: {"items": fresh}  # type: ignore[attr-defined]
    ctl._police_limit(q, ("ns", "q"), held, [(s, 0.0) for s in queue_slots], ctl.monotonic())
    return undone


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


def test_a_slot_numbered_above_max_running_covers_no_new_claim() -> None:
    """A hostile agent makes slots 7 and 8 of a queue whose maxRunning is 1: they cover none of
    its claims, so all but one (slot 0's) are taken back, newest first."""
    clock = _Clock()
    ctl = _controller(clock)
    ctl.on_queue("ADDED", _taskqueue(1, 1, maxRunning=1))
    for i in range(3):
        clock.t += 1
        ctl.on_lease("ADDED", record.read(_held(f"t{i}")))
    assert _uncovered(ctl, [_slot(0), _slot(7), _slot(8)]) == ["t2", "t1"]


def test_lowering_max_running_takes_back_no_claim_made_before() -> None:
    clock = _Clock()
    ctl = _controller(clock)
    ctl.on_queue("ADDED", _taskqueue(1, 1, maxRunning=3))
    for i in range(3):
        ctl.on_lease("ADDED", record.read(_held(f"t{i}")))
    clock.t += 1
    ctl.on_queue("MODIFIED", _taskqueue(2, 1, maxRunning=1))
    assert _uncovered(ctl, [_slot(0), _slot(1), _slot(2)]) == []
    clock.t += 1
    ctl.on_lease("ADDED", record.read(_held("later")))  # slots 1 and 2 are no cover for a new claim
    assert _uncovered(ctl, [_slot(0), _slot(1), _slot(2)]) == ["later"]


def test_a_claim_labelled_with_another_queue_answers_to_its_tasks_queue_once_relabelled() -> None:
    """The claim that creates a Lease chooses its queue label; once the reconciler has written
    the Task's queue back, the claim counts in that queue: its pause and its rate."""
    clock = _Clock()
    ctl = _controller(clock)
    ctl.on_queue("ADDED", _taskqueue(1, 1, claimsPerSecond=0.1))
    for i in range(5):
        ctl.on_lease("ADDED", record.read(_held(f"t{i}", queue="elsewhere")))
    assert not ctl._claims.get(("ns", "q"))
    for i in range(5):
        ctl.on_lease("MODIFIED", record.read(_held(f"t{i}", version="2")))  # relabelled: holder and epoch kept
    assert {h.queue for h in ctl._held.values()} == {"q"}
    undone: list[str] = []
    ctl._undo = lambda q, key, h, why: undone.append(key[1])  # type: ignore[method-assign]
    ctl._police_rate(ctl._queues[("ns", "q")], ("ns", "q"), 0.1, clock.t)
    assert undone == ["t4", "t3"]

"""TaskQueue logic without a control plane: the slot semaphore's arithmetic, the claim-rate
bucket, and how `tasklease top` shows a queue's controls."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from tasklease.api import errors
from tasklease.api.queues import TaskQueueSpec
from tasklease.cli import top
from tasklease.protocol import rate, slots
from tasklease.protocol.slots import Slot

pytestmark = pytest.mark.unit

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def _slot(index: int, holder: str = "", queue: str = "q") -> Slot:
    return Slot(name=slots.slot_name(queue, index), namespace="ns", queue=queue, index=index, holder=holder,
                version="1")


def test_free_slots_are_those_below_the_limit_no_one_holds() -> None:
    known = [_slot(0, "a/1"), _slot(2), _slot(5, "b/1")]
    assert sorted(slots.free_indices(known, 4)) == [1, 2, 3]
    assert slots.free_indices([_slot(0, "a/1")], 1) == []
    assert slots.free_indices([], 0) == []  # maxRunning 0: a queue that runs nothing


def test_surplus_and_uncovered_compare_slots_with_held_leases() -> None:
    known = [_slot(0, "a/1"), _slot(1, "a/1"), _slot(2, "b/1"), _slot(3)]
    assert slots.surplus(known, {"a/1": 1, "b/1": 1}) == {"a/1": 1}
    assert slots.surplus(known, {"a/1": 2, "b/1": 1}) == {}
    assert slots.uncovered(known, {"a/1": 2, "b/1": 3, "rogue/1": 1}) == {"b/1": 2, "rogue/1": 1}


def test_decode_takes_only_well_formed_slots() -> None:
    def lease(name: str, queue: str) -> dict[str, object]:
        return {"metadata": {"name": name, "namespace": "ns", "resourceVersion": "7",
                             "labels": {slots.LABEL_SLOT_OF: queue}}, "spec": {"holderIdentity": "a/1"}}
    assert slots.decode(lease("tasklease-slot.q.3", "q")) == Slot(
        name="tasklease-slot.q.3", namespace="ns", queue="q", index=3, holder="a/1", version="7")
    assert slots.decode(lease("tasklease-slot.q.rate", "q")) is None  # the rate bucket, no slot
    assert slots.decode(lease("tasklease-slot.other.1", "q")) is None
    assert slots.decode(lease("tasklease-slot.q.1", "")) is None


def test_the_rate_bucket_lets_a_burst_go_then_one_claim_per_interval() -> None:
    tat = None
    waits = []
    for _ in range(6):
        wait, after = rate.wait_for_token(tat, NOW, 4.0)
        waits.append(wait)
        if wait == 0:
            tat = after
    assert waits == [0, 0, 0, 0, 0.25, 0.25]  # four at once (one second's claims), then wait
    wait, _ = rate.wait_for_token(tat, NOW + timedelta(seconds=0.25), 4.0)
    assert wait == 0


def test_an_uncertain_clock_waits_by_its_earliest_and_moves_on_from_its_latest() -> None:
    wait, after = rate.wait_for_token(None, NOW, 1.0, NOW + timedelta(seconds=0.5))
    assert (wait, after) == (0.5, NOW + timedelta(seconds=1.5))


def test_a_slow_rate_lets_one_claim_go_then_waits_its_interval() -> None:
    wait, tat = rate.wait_for_token(None, NOW, 0.5)
    assert (wait, tat) == (0, NOW + timedelta(seconds=2))
    assert rate.wait_for_token(tat, NOW, 0.5)[0] == 2


def test_a_next_claim_time_no_claim_could_write_counts_as_now() -> None:
    forged = NOW + timedelta(days=365)  # an agent holding the queue up
    assert rate.wait_for_token(forged, NOW, 2.0) == (0, NOW + timedelta(seconds=0.5))


def test_a_next_claim_time_that_cannot_be_read_counts_as_now() -> None:
    """Any agent may write the bucket: what is no time with a zone stops no claim."""
    for written in ("not-a-time", "2030-01-01T00:00:00", "", None, 7):
        assert rate.arrival(written) is None
    assert rate.arrival("2030-01-01T00:00:00Z") == datetime(2030, 1, 1, tzinfo=UTC)


def test_top_shows_the_controls_and_queues_without_tasks() -> None:
    assert top.describe_controls(None) == "-"
    assert top.describe_controls(TaskQueueSpec()) == "-"
    assert top.describe_controls(TaskQueueSpec(paused=True, max_running=3, claims_per_second=2.5)) == \
        "paused max=3 rate=2.5/s"
    rows = top.summarize([], {}, NOW, controls={("ns", "idle"): TaskQueueSpec(paused=True)})
    assert [(r.queue, r.pending, r.controls) for r in rows] == [("idle", 0, TaskQueueSpec(paused=True))]
    assert "paused" in top.render(rows, title="t")



class _HeldBucket:
    """A claim-rate bucket held by hand, past the policy: the policy refuses every agent's write of it."""

    def __init__(self) -> None:
        self.server_clock = self

    def now(self) -> datetime:
        return NOW

    def latest(self) -> datetime:
        return NOW

    def get_or_none(self, *_: object, **__: object) -> dict[str, object]:
        return {"metadata": {"name": rate.lease_name("q"), "resourceVersion": "3", "annotations": {}},
                "spec": {"holderIdentity": "mallory/1"}}

    def merge_patch(self, *_: object, **__: object) -> None:
        raise errors.Refused("this lease is held by another pod")


def test_a_bucket_no_agent_may_write_stops_no_claim() -> None:
    assert rate.take(_HeldBucket(), namespace="ns", queue="q", rate=1.0) == 0.0  # type: ignore[arg-type]

"""The operator's decision function on made-up times: what to write about one task, and when to look again."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from tasklease.api import models
from tasklease.api.models import Phase
from tasklease.operator import decision
from tasklease.operator.decision import Close, Expire, Now, Observed, Reschedule, Settings, Sighting, TimeOut, Undo
from tasklease.protocol import LeaseRecord, TaskView, record

pytestmark = pytest.mark.unit

T0 = datetime(2030, 1, 1, tzinfo=UTC)
NOW = Now(wall=T0, mono=1000.0)
SETTINGS = Settings(grace_s=2.0, rand=lambda: 0.5)


def view(**spec: Any) -> TaskView:
    meta = {"name": "t", "namespace": "ns", "uid": "u", "creationTimestamp": "2030-01-01T00:00:00Z"}
    return TaskView.of({"metadata": meta, "spec": {"queue": "q", "leaseDurationSeconds": 10, **spec}})


def held(epoch: int = 1) -> LeaseRecord:
    return LeaseRecord(name="t", namespace="ns", queue="q", owner_uid="u", holder="p/1", epoch=epoch,
                       acquired_at=T0, renewed_at=T0, resource_version="7")


def failed(not_before: datetime | None) -> LeaseRecord:
    last = models.Attempt(attempt=1, holder="p/1", claimed_at=T0, ended_at=T0, outcome="Failed")
    return LeaseRecord(name="t", namespace="ns", queue="q", owner_uid="u", epoch=1, error="boom",
                       not_before=not_before, history=(last,), resource_version="8")


def test_a_claimable_task_needs_no_write_and_no_look() -> None:
    assert decision.decide(view(), None, Observed(), NOW, SETTINGS) is None
    assert decision.next_look(view(), None, Observed(), NOW, SETTINGS, delete_at=None) is None


def test_a_cancel_closes_the_task() -> None:
    action = decision.decide(view(cancel=True), held(), Observed(), NOW, SETTINGS)
    assert action == Close(Phase.CANCELLED, "Cancelled", "cancelled on request (spec.cancel)")


def test_a_task_freed_at_the_highest_epoch_is_dead_lettered_for_want_of_one() -> None:
    freed = replace(held(epoch=record.MAX_EPOCH), holder="", budget_from=record.MAX_EPOCH - 1)
    action = decision.decide(view(maxAttempts=3), freed, Observed(), NOW, SETTINGS)
    assert action == Close(Phase.FAILED, "DeadLettered", f"no attempt is left: its epoch reached {record.MAX_EPOCH}")
    spent = replace(freed, budget_from=0, epoch=3)
    assert decision.decide(view(maxAttempts=3), spent, Observed(), NOW, SETTINGS) == Close(
        Phase.FAILED, "DeadLettered", "all 3 attempts are spent")


def test_a_status_past_max_attempts_without_a_lease_is_dead_lettered_saying_so() -> None:
    """No agent may claim it (its attempts count) and none would tell: the operator closes it."""
    spent = replace(view(maxAttempts=2), status_attempt=4, status_phase="Pending")
    assert decision.decide(spent, None, Observed(), NOW, SETTINGS) == Close(
        Phase.FAILED, "DeadLettered", "all 2 attempts are spent: its status shows attempt 4 and it has no Lease")
    assert isinstance(decision.decide(replace(spent, status_attempt=1), None, Observed(), NOW, SETTINGS),
                      decision.Free)


def test_a_task_the_agents_count_as_taken_without_a_lease_gets_a_free_one() -> None:
    """Agents skip a task claimed before that has no Lease, and one whose claim they lost to a
    forged Lease, until they see its Lease free: the operator makes one, at the highest epoch
    remembered (its status, or its own Lease that went: never another task's). A task never
    claimed needs none, nor does one that may not be claimed."""
    claimed_before = replace(view(maxAttempts=3), status_attempt=2, status_phase="Pending")
    assert decision.decide(claimed_before, None, Observed(), NOW, SETTINGS) == decision.Free(
        2, "its status shows attempt 2 and it has no Lease")
    assert decision.decide(claimed_before, None, Observed(gone=(("u", 3), ("forged", 40))), NOW, SETTINGS) == \
        decision.Free(3, "its Lease (attempt 3) went")
    fresh = view()
    assert decision.decide(fresh, None, Observed(), NOW, SETTINGS) is None
    assert decision.decide(fresh, None, Observed(gone=(("forged", 40),)), NOW, SETTINGS) == decision.Free(
        0, "a Lease of another task by its name went")
    later = replace(view(notBefore="2031-01-01T00:00:00Z"), status_attempt=2)
    assert decision.decide(later, None, Observed(gone=(("u", 2),)), NOW, SETTINGS) is None


def test_a_held_lease_expires_after_duration_plus_grace_of_one_unchanged_version() -> None:
    seen = Observed(held_since=988.0, silent_s=12.0, sighting=Sighting(1, record.HELD, T0))
    assert decision.decide(view(), held(), seen, Now(T0, 999.9), SETTINGS) is None
    assert decision.decide(view(), held(), seen, NOW, SETTINGS) == Expire("timeout", 12.0)
    assert decision.next_look(view(), held(), seen, Now(T0, 990.0), SETTINGS, delete_at=None) == 1000.0


def test_a_held_lease_expires_by_the_longest_duration_its_task_had_during_the_attempt() -> None:
    seen = Observed(held_since=988.0, silent_s=12.0, sighting=Sighting(1, record.HELD, T0), duration_s=60)
    assert decision.decide(view(), held(), seen, NOW, SETTINGS) is None  # the view says 10 s now
    assert decision.next_look(view(), held(), seen, NOW, SETTINGS, delete_at=None) == 988.0 + 60 + 2


def test_an_unseen_version_never_expires_and_a_gone_pod_expires_at_once() -> None:
    assert decision.decide(view(), held(), Observed(held_since=None, silent_s=50.0), NOW, SETTINGS) is None
    assert decision.decide(view(), held(), Observed(held_since=999.0, pod_gone=True, silent_s=1.0), NOW,
                           SETTINGS) == Expire("pod-gone", 1.0)


def test_an_attempt_times_out_by_when_its_claim_was_first_seen() -> None:
    seen = Observed(held_since=999.0, attempt_since=940.0)
    assert decision.decide(view(attemptTimeoutSeconds=60), held(), seen, NOW, SETTINGS) == TimeOut(60.0)
    assert decision.decide(view(attemptTimeoutSeconds=61), held(), seen, NOW, SETTINGS) is None
    assert decision.decide(view(), held(), seen, NOW, Settings(grace_s=2.0, attempt_timeout_s=30)) == TimeOut(60.0)
    assert decision.next_look(view(attemptTimeoutSeconds=61), held(), seen, NOW, SETTINGS, delete_at=None) == 1001.0


def test_a_claim_seen_before_the_task_was_claimable_is_undone() -> None:
    start = T0 + timedelta(minutes=5)
    seen = Observed(sighting=Sighting(1, record.HELD, T0), held_since=1000.0)
    action = decision.decide(view(notBefore=start.isoformat()), held(), seen, NOW, SETTINGS)
    assert isinstance(action, Undo) and action.not_before == start


def test_a_backoff_the_holder_wrote_too_long_is_put_right_by_when_we_saw_it_end() -> None:
    seen = Observed(sighting=Sighting(1, record.FREE, T0, witnessed=True))
    far = failed(T0 + timedelta(hours=1))
    action = decision.decide(view(backoff={"initialSeconds": 10, "jitter": 0}), far, seen, NOW, SETTINGS)
    assert action == Reschedule(T0 + timedelta(seconds=10))
    fair = failed(T0 + timedelta(seconds=10))
    assert decision.decide(view(backoff={"initialSeconds": 10, "jitter": 0}), fair, seen, NOW, SETTINGS) is None


def test_a_release_that_puts_its_task_off_is_cut_to_one_backoff_from_when_we_saw_it_free() -> None:
    """Only a failure's backoff is the operator's to measure, but no holder's write, whatever its
    history says, puts a task off for longer than one backoff (docs/security.md)."""
    seen = Observed(sighting=Sighting(1, record.FREE, T0, witnessed=True))
    spec = {"backoff": {"initialSeconds": 10, "jitter": 0}}
    last = models.Attempt(attempt=1, holder="p/1", claimed_at=T0, ended_at=T0, outcome="Released")
    released = replace(failed(None), error="", history=(last,))
    assert decision.decide(view(**spec), released, seen, NOW, SETTINGS) is None  # as the protocol releases
    years = replace(released, not_before=T0 + timedelta(days=365 * 900))
    assert decision.decide(view(**spec), years, seen, NOW, SETTINGS) == Reschedule(T0 + timedelta(seconds=10))
    unwritten = replace(years, history=())  # no attempt ended at all
    assert decision.decide(view(**spec), unwritten, seen, NOW, SETTINGS) == Reschedule(T0 + timedelta(seconds=10))
    within = replace(released, not_before=T0 + timedelta(seconds=5))
    assert decision.decide(view(**spec), within, seen, NOW, SETTINGS) is None
    # The Task's own delayed start is no writer's: it is kept.
    start = T0 + timedelta(days=2)
    assert decision.decide(view(notBefore=start.isoformat(), **spec), replace(released, not_before=start), seen,
                           NOW, SETTINGS) is None


def test_the_next_look_is_the_soonest_of_a_delayed_start_a_ttl_and_a_deadline() -> None:
    later = view(notBefore=(T0 + timedelta(seconds=30)).isoformat(), deadline=(T0 + timedelta(seconds=20)).isoformat())
    assert decision.next_look(later, None, Observed(), NOW, SETTINGS, delete_at=T0 + timedelta(seconds=5)) == 1005.0
    assert decision.next_look(later, None, Observed(), NOW, SETTINGS, delete_at=None) == 1020.0


def test_the_end_of_a_backoff_is_looked_at_so_the_status_stops_saying_backing_off() -> None:
    free = failed(T0 + timedelta(seconds=30))
    seen = Observed(sighting=Sighting(1, record.FREE, T0, witnessed=True))
    assert decision.next_look(view(), free, seen, NOW, SETTINGS, delete_at=None) == 1030.0
    assert decision.next_look(view(), failed(T0 - timedelta(seconds=1)), seen, NOW, SETTINGS, delete_at=None) is None

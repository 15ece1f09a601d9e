"""Lifecycle rules with a pinned clock, no API server: delayed start, retry budgets, TTL
cleanup, the retry projection, and the failure message's stderr tail."""

from __future__ import annotations

import pytest

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from tasklease.agent.runner import failure_message
from tasklease.api import models
from tasklease.operator import cleanup, projection
from tasklease.protocol import record
from tasklease.protocol.rules import (
    Blocker,
    TaskView,
    blocker,
    claimed,
    ended,
    requeued,
    retried,
    why_not_claimable,
    why_not_retryable,
)

pytestmark = pytest.mark.unit  # pure logic: `make unit` runs it, on every Python

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def _task(phase: str = "", **spec: object) -> TaskView:
    return TaskView(name="t", namespace="ns", uid="uid-1", spec=models.TaskSpec.model_validate({"queue": "q", **spec}),
                    created="2026-01-01T00:00:00Z", status_phase=phase)


def _dead_lettered(task: TaskView) -> record.LeaseRecord:
    rec = None
    for n in range(task.spec.max_attempts):
        rec = requeued(claimed(task, rec, f"pod/{n}", NOW), task.spec, outcome="Failed", message="boom", now=NOW,
                       backoff=False)
    assert rec is not None and rec.reason == "DeadLettered"
    return rec


def test_a_delayed_start_blocks_claims_until_its_time_with_or_without_a_lease() -> None:
    later = NOW + timedelta(minutes=5)
    task = _task(notBefore=later.isoformat())
    assert blocker(task, None, NOW) is Blocker.SCHEDULED
    assert "scheduled for" in (why_not_claimable(task, None, NOW) or "")
    assert blocker(task, None, later) is None
    # A cancel or a deadline still wins over a delayed start: the operator acts on those.
    assert blocker(_task(notBefore=later.isoformat(), cancel=True), None, NOW) is Blocker.CANCELLED


def test_backoff_never_ends_before_the_delayed_start() -> None:
    later = NOW + timedelta(minutes=5)
    task = _task(notBefore=later.isoformat(), backoff={"initialSeconds": 5, "maxSeconds": 60})
    freed = requeued(claimed(task, None, "pod/1", NOW), task.spec, outcome="Expired", message="", now=NOW,
                     backoff=True)
    assert freed.not_before == later
    no_backoff = requeued(claimed(task, None, "pod/1", NOW), task.spec, outcome="Released", message="", now=NOW,
                          backoff=False)
    assert no_backoff.not_before == later


def test_retry_grants_a_fresh_budget_keeps_history_and_the_epoch_grows() -> None:
    task = _task(maxAttempts=2)
    dead = _dead_lettered(task)
    assert blocker(task, dead, NOW) is Blocker.CLOSED
    assert why_not_retryable(task, dead, NOW) is None
    again = retried(dead, NOW)
    assert (again.state, again.epoch, again.budget_from) == (record.FREE, 2, 2)
    assert [a.attempt for a in again.history] == [1, 2]
    assert blocker(task, again, NOW) is None
    third = claimed(task, again, "pod/x", NOW)
    assert third.epoch == 3  # never a repeat of an earlier epoch
    # Two more attempts, then dead-lettered again.
    freed = requeued(third, task.spec, outcome="Failed", message="", now=NOW, backoff=False)
    assert freed.state == record.FREE
    fourth = requeued(claimed(task, freed, "pod/y", NOW), task.spec, outcome="Failed", message="", now=NOW,
                      backoff=False)
    assert (fourth.state, fourth.reason, fourth.epoch) == (record.CLOSED, "DeadLettered", 4)


def test_the_retry_budget_survives_the_wire() -> None:
    again = retried(_dead_lettered(_task(maxAttempts=2)), NOW)
    assert record.decode({**record.encode(again), "metadata": {**record.encode(again)["metadata"],
                                                               "resourceVersion": "1"}}).budget_from == 2


def test_only_failed_tasks_are_retried() -> None:
    task = _task()
    done = ended(claimed(task, None, "pod/1", NOW), outcome="Succeeded", now=NOW,
                 close=models.Phase.SUCCEEDED.value, reason="Completed")
    assert "never re-run" in (why_not_retryable(task, done, NOW) or "")
    assert "not finished" in (why_not_retryable(task, claimed(task, None, "pod/1", NOW), NOW) or "")
    assert why_not_retryable(task, None, NOW) is not None
    dead = _dead_lettered(_task(maxAttempts=1))
    assert "cancelled" in (why_not_retryable(_task(maxAttempts=1, cancel=True), dead, NOW) or "")
    assert "deadline" in (why_not_retryable(_task(maxAttempts=1, deadline=NOW.isoformat()), dead, NOW) or "")


def _task_json(status: models.TaskStatus, **spec: object) -> dict[str, object]:
    return {"metadata": {"name": "t", "namespace": "ns", "uid": "uid-1", "generation": 1},
            "spec": {"queue": "q", **spec}, "status": status.model_dump(mode="json", by_alias=True)}


def test_the_projection_leaves_a_terminal_phase_only_after_a_retry() -> None:
    task = _task(maxAttempts=1)
    dead = _dead_lettered(task)
    old = projection.project(_task_json(models.TaskStatus()), dead, old=models.TaskStatus(), now=NOW)
    assert (old.phase, old.reason) == (models.Phase.FAILED, "DeadLettered")
    # A Lease deleted by hand (or anything but a retry) does not move it.
    assert projection.project(_task_json(old), None, old=old, now=NOW) == old
    new = projection.project(_task_json(old), retried(dead, NOW), old=old, now=NOW)
    assert (new.phase, new.attempt) == (models.Phase.PENDING, 1)
    assert "Retried" in [t.reason for t in projection.transitions(old, new)]


def test_a_held_task_reads_pod_bound_while_its_lease_is_bound_to_its_holders_pod() -> None:
    held = claimed(_task(), None, "pod/1", NOW)
    task = _task_json(models.TaskStatus())
    assert projection.project(task, held, old=models.TaskStatus(), now=NOW).reason == "Held"
    bound = projection.project(task, replace(held, pod_bound="1234-uid"), old=models.TaskStatus(), now=NOW)
    assert (bound.phase, bound.reason) == (models.Phase.RUNNING, "PodBound")


def test_a_scheduled_task_is_projected_with_its_start_time() -> None:
    later = NOW + timedelta(minutes=5)
    status = projection.project(_task_json(models.TaskStatus(), notBefore=later.isoformat()), None,
                                old=models.TaskStatus(), now=NOW)
    assert (status.phase, status.reason, status.not_before) == (models.Phase.PENDING, "Scheduled", later)
    after = projection.project(_task_json(models.TaskStatus(), notBefore=later.isoformat()), None,
                               old=models.TaskStatus(), now=later)
    assert after.reason == "Waiting"


def test_only_a_never_written_waiting_task_goes_without_a_status_write() -> None:
    fresh = models.TaskStatus()  # what the API server serves for a Task nobody wrote (the CRD default)
    waiting = projection.project(_task_json(fresh), None, old=fresh, now=NOW)
    assert projection.unwritten(fresh, waiting)
    later = (NOW + timedelta(minutes=5)).isoformat()
    scheduled = projection.project(_task_json(fresh, notBefore=later), None, old=fresh, now=NOW)
    assert not projection.unwritten(fresh, scheduled)  # the start time must show
    task = _task()
    requeued_once = projection.project(_task_json(fresh), requeued(claimed(task, None, "pod/0", NOW), task.spec,
                                                                  outcome="Failed", message="boom", now=NOW,
                                                                  backoff=False), old=fresh, now=NOW)
    assert requeued_once.phase is models.Phase.PENDING and not projection.unwritten(fresh, requeued_once)
    # Once written, the operator keeps the status true: a Scheduled task becomes Waiting by a write.
    after = projection.project(_task_json(scheduled, notBefore=later), None, old=scheduled,
                               now=NOW + timedelta(hours=1))
    assert after.reason == "Waiting" and not projection.unwritten(scheduled, after)


def test_a_task_backs_off_until_its_not_before_and_then_waits() -> None:
    task = _task(backoff={"initialSeconds": 10, "maxSeconds": 10, "jitter": False})
    failed = requeued(claimed(task, None, "pod/1", NOW), task.spec, outcome="Failed", message="boom", now=NOW,
                      backoff=True)
    body = {"metadata": {"uid": task.uid, "generation": 1}, "spec": {}}
    during = projection.project(body, failed, old=models.TaskStatus(), now=NOW + timedelta(seconds=9))
    after = projection.project(body, failed, old=during, now=NOW + timedelta(seconds=10))
    assert (during.reason, after.reason) == ("BackingOff", "Failed")
    assert after.phase is models.Phase.PENDING


def test_ttl_counts_from_the_end_and_keeps_dead_letters() -> None:
    task = _task(ttlSecondsAfterFinished=60)
    done = ended(claimed(task, None, "pod/1", NOW), outcome="Succeeded", now=NOW,
                 close=models.Phase.SUCCEEDED.value, reason="Completed")
    finished = models.TaskStatus(phase=models.Phase.SUCCEEDED, completed_at=NOW)
    assert cleanup.delete_at(task, finished, done, default_ttl_s=None) == NOW + timedelta(seconds=60)
    assert cleanup.delete_at(_task(), finished, done, default_ttl_s=5) == NOW + timedelta(seconds=5)
    assert cleanup.delete_at(_task(), finished, done, default_ttl_s=None) is None
    assert cleanup.delete_at(task, models.TaskStatus(), None, default_ttl_s=None) is None  # not finished
    dead = _dead_lettered(_task(maxAttempts=1, ttlSecondsAfterFinished=0))
    failed = models.TaskStatus(phase=models.Phase.FAILED, reason="DeadLettered", completed_at=NOW)
    assert cleanup.delete_at(_task(maxAttempts=1, ttlSecondsAfterFinished=0), failed, dead, default_ttl_s=0) is None
    reopened = retried(dead, NOW)
    assert cleanup.delete_at(task, failed, replace(reopened, reason=""), default_ttl_s=0) is None
    for endless in (10**12, 10**17):  # the schema allows them; they end after the year 9999: never
        assert cleanup.delete_at(_task(ttlSecondsAfterFinished=endless), finished, done, default_ttl_s=None) is None


def test_the_failure_message_keeps_the_end_of_stderr_within_the_limit() -> None:
    assert failure_message("sh exited with code 3", "") == "sh exited with code 3"
    text = failure_message("sh exited with code 3", "x" * 5000 + "the real cause\n", limit=100)
    assert len(text) == 100 and text.startswith("sh exited with code 3: ") and text.endswith("the real cause")

"""The pure transitions of a task's Lease, and the one claimability rule. No I/O here.

Every function takes the time it decides with, so tests pin it. `why_not_claimable` is
the only statement of "may this task be claimed now?": the agents' server-side
selectors and the chart's admission policy are checked against it case by case.
"""

from __future__ import annotations

import enum
import functools
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from tasklease.api import models
from tasklease.api.timestamps import format_time
from tasklease.kube import JSON
from tasklease.protocol.record import CLOSED, HELD, MAX_EPOCH, LeaseRecord


@dataclass(frozen=True)
class TaskView:
    """The parts of a Task the protocol decides with."""

    name: str
    namespace: str
    uid: str
    spec: models.TaskSpec
    created: str
    status_attempt: int = 0
    status_phase: str = ""

    @classmethod
    def of(cls, task: JSON) -> TaskView:
        meta = task["metadata"]
        status = task.get("status") or {}
        return cls(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"],
                   spec=models.TaskSpec.model_validate(task.get("spec", {})),
                   created=meta.get("creationTimestamp", ""),
                   status_attempt=int(status.get("attempt") or 0), status_phase=str(status.get("phase") or ""))

    @functools.cached_property
    def payload_too_deep(self) -> bool:
        """Measured once per view: an agent judges the views of its window again on every look."""
        return models.payload_depth(self.spec.payload) > models.MAX_PAYLOAD_DEPTH


def fresh_record(task: TaskView) -> LeaseRecord:
    """A first Lease for `task`, at the epoch its status remembers (not 0 when a Lease was
    deleted by hand): a retry of one the operator closes counts its budget from there."""
    return LeaseRecord(name=task.name, namespace=task.namespace, queue=task.spec.queue, owner_uid=task.uid,
                       duration_s=task.spec.lease_duration_seconds, epoch=min(task.status_attempt, MAX_EPOCH))


class Blocker(enum.Enum):
    """Why a task may not be claimed now. The operator acts on the same answer: it closes a
    CANCELLED or PAST_DEADLINE task, dead-letters a SPENT one and watches a HELD one."""

    FINISHED = "finished"  # its status is terminal, even if its Lease was deleted by hand
    FOREIGN = "foreign"  # its Lease belongs to an older task of the same name
    CLOSED = "closed"
    CANCELLED = "cancelled"
    INVALID_PAYLOAD = "invalid-payload"  # nested deeper than models.MAX_PAYLOAD_DEPTH
    PAST_DEADLINE = "past-deadline"
    SCHEDULED = "scheduled"  # spec.notBefore is still ahead: a delayed start
    HELD = "held"
    SPENT = "spent"
    BACKING_OFF = "backing-off"


def blocker(task: TaskView, rec: LeaseRecord | None, now: datetime) -> Blocker | None:
    """The claimability rule, in one place: None when `task` may be claimed now."""
    if task.status_phase in models.TERMINAL_PHASES:
        return Blocker.FINISHED
    if rec is not None and rec.owner_uid != task.uid:
        return Blocker.FOREIGN
    if rec is not None and rec.state == CLOSED:
        return Blocker.CLOSED
    if task.spec.cancel:
        return Blocker.CANCELLED
    if task.payload_too_deep:
        return Blocker.INVALID_PAYLOAD
    if task.spec.deadline is not None and now >= task.spec.deadline:
        return Blocker.PAST_DEADLINE
    if task.spec.not_before is not None and now < task.spec.not_before:
        return Blocker.SCHEDULED
    if rec is not None and rec.state == HELD:
        return Blocker.HELD
    if epochs_spent(task, rec) or attempts_used(task, rec) >= task.spec.max_attempts:
        return Blocker.SPENT
    if rec is None:
        return None
    if rec.not_before is not None and now < rec.not_before:
        return Blocker.BACKING_OFF
    return None


def why_not_claimable(task: TaskView, rec: LeaseRecord | None, now: datetime) -> str | None:
    """`blocker` in words, for logs and errors; None when `task` may be claimed now."""
    found = blocker(task, rec, now)
    if found is None:
        return None
    if found is Blocker.FINISHED:
        return f"finished ({task.status_phase})"
    if found is Blocker.FOREIGN:
        return "its Lease belongs to an older task of the same name"
    if rec is not None and found is Blocker.CLOSED:
        return f"closed ({rec.outcome})"
    if rec is not None and found is Blocker.HELD:
        return f"held by {rec.holder}"
    if rec is not None and found is Blocker.BACKING_OFF:
        return f"backing off until {format_time(rec.not_before)}"
    if found is Blocker.SCHEDULED:
        return f"scheduled for {format_time(task.spec.not_before)}"
    if found is Blocker.INVALID_PAYLOAD:
        return invalid_payload(task.spec)
    return {Blocker.CANCELLED: "cancelled", Blocker.PAST_DEADLINE: "past its deadline"}.get(found, "attempts spent")


def invalid_payload(spec: models.TaskSpec) -> str:
    return (f"its payload is nested {models.payload_depth(spec.payload)} levels deep; "
            f"the limit is {models.MAX_PAYLOAD_DEPTH}")


def attempts_made(task: TaskView, rec: LeaseRecord | None) -> int:
    """The highest epoch ever handed out for `task`, from every place that remembers one: the
    Lease (whose leaseTransitions anyone with rights can lower by hand), its attempt history,
    and the status projection (which survives the Lease's deletion). Fencing needs the next
    epoch to exceed all of them."""
    epochs = [task.status_attempt]
    if rec is not None:
        epochs += [rec.epoch, *(a.attempt for a in rec.history)]
    return max(epochs)


def epochs_spent(task: TaskView, rec: LeaseRecord | None) -> bool:
    """No epoch is left to claim with: the next would not fit the Lease's leaseTransitions (a
    claim written with it would be refused, whatever maxAttempts and `tasklease retry` allow)."""
    return attempts_made(task, rec) >= MAX_EPOCH


def attempts_used(task: TaskView, rec: LeaseRecord | None) -> int:
    """Claims made since the last `tasklease retry` (or ever): what maxAttempts bounds. Without
    a Lease no retry is remembered: the attempts the status remembers all count."""
    return attempts_made(task, rec) - (rec.budget_from if rec is not None else 0)


def claimed(task: TaskView, rec: LeaseRecord | None, holder: str, now: datetime) -> LeaseRecord:
    base = rec or fresh_record(task)
    epoch = attempts_made(task, rec) + 1
    entry = models.Attempt(attempt=epoch, holder=holder, claimed_at=now)
    return replace(base, holder=holder, epoch=epoch, duration_s=task.spec.lease_duration_seconds,
                   acquired_at=now, renewed_at=now, not_before=None, pod_bound="",
                   history=(*base.history, entry)[-models.MAX_HISTORY:])


def ended(rec: LeaseRecord, *, outcome: str, now: datetime, message: str = "", close: str = "",
           reason: str = "", result: str = "", not_before: datetime | None = None) -> LeaseRecord:
    """End the current attempt (if any) with `outcome`; `close` makes the Lease terminal."""
    history = rec.history
    if rec.holder and history and history[-1].attempt == rec.epoch and not history[-1].outcome:
        last = history[-1].model_copy(
            update={"ended_at": now, "outcome": outcome, "message": message[:models.MAX_ERROR_CHARS]})
        history = (*history[:-1], last)
    # lastError tells why a task is not done yet; a success has nothing left to explain.
    error = "" if close == models.Phase.SUCCEEDED.value else (
        message[:models.MAX_ERROR_CHARS]
        if outcome in ("Failed", "Expired", models.ATTEMPT_TIMED_OUT) or close == models.Phase.FAILED.value
        else rec.error)
    return replace(rec, holder="", renewed_at=now, outcome=close, reason=reason, result=result,
                   error=error, not_before=not_before, history=history, pod_bound="")


def requeued(rec: LeaseRecord, spec: models.TaskSpec, *, outcome: str, message: str, now: datetime,
              backoff: bool, rand: Callable[[], float] = random.random) -> LeaseRecord:
    """Free for the next attempt, or dead-lettered when the attempts are spent (I3). The
    backoff is jittered with `rand` (`models.Backoff.jittered`)."""
    if rec.epoch - rec.budget_from >= spec.max_attempts:
        return ended(rec, outcome=outcome, now=now, message=message, close=models.Phase.FAILED.value,
                      reason="DeadLettered")
    not_before = (now + timedelta(seconds=spec.backoff.jittered(rec.epoch - rec.budget_from, rand))
                  if backoff else None)
    if spec.not_before is not None and spec.not_before > now:
        not_before = max(not_before or spec.not_before, spec.not_before)  # backoff respects a delayed start
    return ended(rec, outcome=outcome, now=now, message=message, not_before=not_before)


def undone(rec: LeaseRecord, *, now: datetime, message: str, not_before: datetime | None) -> LeaseRecord:
    """Take back a claim made while the task was not claimable: free again, waiting for
    `not_before`, and the attempt not counted. Its epoch stays spent (a fencing token is
    never handed out twice): budget-from moves up by one, so `maxAttempts` still allows
    as many claims as before it."""
    return replace(ended(rec, outcome="Undone", now=now, message=message, not_before=not_before),
                   budget_from=rec.budget_from + 1)


def why_not_retryable(task: TaskView, rec: LeaseRecord | None, now: datetime) -> str | None:
    """None when `tasklease retry` may give this finished task a fresh budget of attempts:
    only a Failed task (dead-lettered or failed for good). A Succeeded task never runs again
    (a new task is the way), a cancel cannot be undone, a deadline does not move."""
    if rec is None or rec.owner_uid != task.uid:
        return "it has no Lease of its own to retry"
    if rec.state != CLOSED:
        return f"it is not finished ({rec.state}); `tasklease requeue` gives a running task back"
    if rec.outcome != models.Phase.FAILED.value:
        return (f"it ended {rec.outcome}; a Succeeded task is never re-run: submit a new task"
                if rec.outcome == models.Phase.SUCCEEDED.value else f"it ended {rec.outcome}, for good")
    if task.spec.cancel:
        return "it is cancelled (spec.cancel cannot be undone)"
    if task.spec.deadline is not None and now >= task.spec.deadline:
        return "it is past its deadline"
    return None


def retried(rec: LeaseRecord, now: datetime) -> LeaseRecord:
    """closed(Failed) → free, with maxAttempts claims counted from the current epoch. The
    epoch, the history and the last error stay: the next claim is epoch E+1 (I2)."""
    return replace(rec, holder="", outcome="", reason="", result="", not_before=None, renewed_at=now,
                   budget_from=rec.epoch)


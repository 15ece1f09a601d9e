"""Task.status as a pure function of the Task and its Lease, and the Events between two statuses.

The Lease is the truth; the status is what `kubectl get tasks` shows of it. Computing it
from scratch every time makes the operator's writes idempotent: the same inputs always
give the same status, and an operator that restarts recomputes instead of remembering.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from tasklease.api import models
from tasklease.api.timestamps import parse_time
from tasklease.protocol import LeaseRecord, record
from tasklease.api.models import MAX_ERROR_CHARS, MAX_HISTORY, MAX_RESULT_BYTES, Phase, TaskStatus


@dataclass(frozen=True)
class Transition:
    """One Event to post on the Task."""

    type: str  # Normal | Warning
    reason: str  # Claimed, Expired, Requeued, Succeeded, Failed, DeadLettered, Cancelled, ...
    message: str

    @property
    def happy(self) -> bool:
        """A step of the happy path (claimed, succeeded): at scale these Events are optional,
        the abnormal ones are always posted."""
        return self.reason in HAPPY_REASONS


HAPPY_REASONS = ("Claimed", "Succeeded")


def project(task: dict[str, Any], rec: LeaseRecord | None, *, old: TaskStatus, now: datetime) -> TaskStatus:
    """The status `task` should have, given its Lease `rec` and its current status `old`."""
    generation = int(task["metadata"].get("generation") or 0)
    own = rec is not None and rec.owner_uid == task["metadata"]["uid"]
    if old.phase.terminal and not (own and rec is not None and (
            (rec.state == record.CLOSED and rec.outcome == old.phase.value) or _retried_after(rec, old))):
        # I4: a terminal phase is final, even if its Lease was deleted or recreated by hand;
        # only `tasklease retry` (a Failed Lease reopened with a fresh budget) leads out of it.
        return old
    if rec is None or not own:
        status = TaskStatus(phase=Phase.PENDING, reason="Waiting", attempt=old.attempt, history=old.history)
    else:
        status = _from_lease(rec, now)
        # When it finished is when we saw it finish (a TTL counts from it), not the time its
        # writer put on the Lease.
        if status.phase.terminal:
            status.completed_at = old.completed_at if old.phase is status.phase and old.completed_at else now
    scheduled = parse_time((task.get("spec") or {}).get("notBefore"))
    if status.phase is Phase.PENDING and scheduled is not None and scheduled > now:
        status.reason = "Scheduled"
        status.not_before = max(status.not_before or scheduled, scheduled)
    # The attempt is a fencing epoch: it never goes down, even if the Lease's leaseTransitions
    # was lowered by hand (the next claim then starts above this, see rules.attempts_made).
    status.attempt = max(status.attempt, old.attempt)
    status.observed_generation = generation
    return status


# A status write is conditional on the version we read, and on the uid: not a Task recreated under its name.
_STATUS_WRITE_METADATA = ("name", "namespace", "uid", "resourceVersion")


def status_write(task: dict[str, Any], status: TaskStatus) -> dict[str, Any]:
    """The body of the write of `status` to `task`'s status subresource. The subresource keeps
    everything but the status from the stored Task: the body carries only what names it and
    makes the write conditional (its spec would be decoded and thrown away by the API server,
    at every status write)."""
    meta = task["metadata"]
    return {"apiVersion": f"{models.GROUP}/{models.VERSION}", "kind": models.KIND,
            "metadata": {k: meta[k] for k in _STATUS_WRITE_METADATA if k in meta},
            "status": status.model_dump(mode="json", by_alias=True, exclude_none=True)}


def unwritten(old: TaskStatus, new: TaskStatus) -> bool:
    """`old` is the CRD's default (the operator never wrote this Task) and `new` says no more
    than it: a task still waiting for its first claim needs no write; it reads Pending. Skipping
    this write matters at scale: each one reaches every agent watching the queue."""
    return (old.observed_generation == 0 and new.phase is Phase.PENDING and new.reason == "Waiting"
            and new.attempt == 0 and not new.history)


def _retried_after(rec: LeaseRecord, old: TaskStatus) -> bool:
    """The Lease was reopened by `tasklease retry` after the attempt `old` ended with."""
    return rec.state != record.CLOSED and rec.budget_from > 0 and rec.budget_from >= old.attempt


def _from_lease(rec: LeaseRecord, now: datetime) -> TaskStatus:
    """Fields longer than the status allows (`record.decode` marks them, the operator reports
    them) are cut to fit with a visible mark: a status that can never be written would stop
    the projection of this task for good."""
    last = rec.history[-1] if rec.history else None
    status = TaskStatus(attempt=rec.epoch, history=list(rec.history[-MAX_HISTORY:]),
                        last_error=_fit(rec.error, MAX_ERROR_CHARS),
                        claimed_at=rec.acquired_at if rec.epoch else None, not_before=rec.not_before)
    if rec.state == record.HELD:
        # Not renewTime: the status changes when the holder changes, never per heartbeat
        # (a write per renewal would reach every watcher of the Task). The Lease has it.
        # A lease bound to its holder's Pod has no heartbeat of the holder's own: the reason
        # says so, for `kubectl get -o wide` (docs/pod-bound.md).
        status.phase, status.reason = Phase.RUNNING, "PodBound" if rec.pod_bound else "Held"
        status.holder = _fit(rec.holder, record.MAX_HOLDER_CHARS)
    elif rec.state == record.CLOSED:
        status.phase, status.reason = Phase(rec.outcome), _fit(rec.reason, record.MAX_REASON_CHARS)
        status.result = _fit(rec.result, MAX_RESULT_BYTES)
    else:
        status.phase = Phase.PENDING
        # Backing off only until not-before: the operator looks again then (`decision.next_look`).
        backing_off = rec.not_before is not None and rec.not_before > now
        status.reason = "BackingOff" if backing_off else (last.outcome if last and last.outcome else "Waiting")
    return status


_CUT: Final = "...[cut]"


def _fit(value: str, limit: int) -> str:
    return value if len(value) <= limit else value[:limit - len(_CUT)] + _CUT


def transitions(old: TaskStatus, new: TaskStatus) -> list[Transition]:
    """The Events that explain how `old` became `new`, oldest first: attempt-level ones
    (Claimed, Expired, Failed, Released) from the history, task-level ones from the phase."""
    before = {a.attempt: a for a in old.history}
    out: list[Transition] = []
    for a in new.history:
        seen = before.get(a.attempt)
        if seen is None:
            out.append(Transition("Normal", "Claimed", f"attempt {a.attempt} claimed by {a.holder}"))
        if a.outcome in _ATTEMPT_EVENTS and not (seen and seen.outcome):
            out.append(Transition("Warning" if a.outcome != "Released" else "Normal", a.outcome,
                                  f"attempt {a.attempt} of {a.holder}: {a.message or a.outcome.lower()}"))
    if old.phase.terminal and not new.phase.terminal:
        out.append(Transition("Normal", "Retried", f"retried after attempt {new.attempt}: a fresh budget of attempts"))
    moved = new.phase is not old.phase or new.attempt != old.attempt
    if new.phase is Phase.PENDING and new.attempt and moved:
        when = f"at {new.not_before.strftime('%H:%M:%SZ')} (backoff)" if new.not_before else "now"
        out.append(Transition("Normal", "Requeued", f"attempt {new.attempt + 1} may start {when}"))
    if new.phase.terminal and not old.phase.terminal:
        reason = "DeadLettered" if new.reason == "DeadLettered" else new.phase.value
        detail = f": {new.last_error}" if new.phase is Phase.FAILED and new.last_error else ""
        out.append(Transition("Warning" if new.phase is Phase.FAILED else "Normal", reason,
                              f"task {new.phase.value.lower()} after {new.attempt} attempt(s) ({new.reason}){detail}"))
    return out


_ATTEMPT_EVENTS = ("Expired", "Failed", "Released", "Undone", models.ATTEMPT_TIMED_OUT)

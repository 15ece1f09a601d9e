"""When a finished Task is deleted with its Lease: `spec.ttlSecondsAfterFinished`, as Jobs have it.

Pure: the reconciler asks `delete_at` and does the delete. A dead-lettered task is kept
whatever its TTL: somebody has to choose (`tasklease retry`, or `kubectl delete`).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from tasklease.api.models import TaskStatus
from tasklease.protocol import CLOSED, LeaseRecord, TaskView

KEPT_REASONS = ("DeadLettered",)


def delete_at(task: TaskView, status: TaskStatus, rec: LeaseRecord | None, *,
              default_ttl_s: int | None) -> datetime | None:
    """When `task` is due for deletion; None while it is not finished, or is kept."""
    ttl = task.spec.ttl_seconds_after_finished
    if ttl is None:
        ttl = default_ttl_s
    if ttl is None or not status.phase.terminal:
        return None
    own = rec is not None and rec.owner_uid == task.uid
    if own and rec is not None and rec.state != CLOSED:
        return None  # reopened by `tasklease retry`; the projection will follow
    reason = rec.reason if own and rec is not None else status.reason
    # completedAt is when the operator saw the task finish, on the API server's clock; never
    # a time the Lease's writer chose.
    if reason in KEPT_REASONS or status.completed_at is None:
        return None
    try:
        return status.completed_at + timedelta(seconds=ttl)
    except OverflowError:  # a TTL the schema allows that ends after the year 9999: never, then
        return None

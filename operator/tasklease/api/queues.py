"""The TaskQueue resource: a queue's controls (pause, concurrency limit, claim rate) and its status.

Optional: a queue without a TaskQueue of its name runs as if it had one with no controls.
The CRD (`crds/taskqueues.tasklease.dev.yaml`) is generated from these classes by
`tasklease.api.crd`. No I/O here.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Final

from pydantic import Field

from tasklease.api.models import DNS_LABEL, _Model
from tasklease.api.resource import QUEUE_KIND as QUEUE_KIND
from tasklease.api.resource import QUEUE_PLURAL as QUEUE_PLURAL

# The Events the operator posts on a TaskQueue.
PAUSED: Final = "Paused"
RESUMED: Final = "Resumed"
LIMIT_REACHED: Final = "LimitReached"
# A claim an agent made against the queue's controls, taken back by the operator (its Lease's
# history says Undone, with this reason in the message; an Event of this reason on the TaskQueue).
CLAIM_UNDONE: Final = "ClaimUndone"


class TaskQueueSpec(_Model):
    """What agents may take from the queue, and how fast."""

    paused: bool = Field(
        default=False,
        description="True: agents claim nothing from this queue; running tasks go on. A claim made while paused "
                    "is taken back by the operator (not counted against maxAttempts).")
    max_running: int | None = Field(
        default=None, ge=0, le=10000,
        description="Most tasks of this queue held at once: agents take one of maxRunning slot Leases "
                    "(tasklease-slot.<queue>.<n>) before a claim. None: no limit.")
    claims_per_second: float | None = Field(
        default=None, ge=0.01, le=10000,
        description="Most claims per second from this queue, across all agents (a token bucket of one "
                    "second's claims). None: no limit.")


class TaskQueueStatus(_Model):
    """Written by the operator from its picture of the queue's Tasks and Leases."""

    pending: int = Field(default=0, ge=0, description="Tasks in phase Pending (claimable, backing off or not yet due).")
    running: int = Field(default=0, ge=0, description="Leases held now.")
    succeeded: int = Field(default=0, ge=0)
    failed: int = Field(default=0, ge=0)
    cancelled: int = Field(default=0, ge=0)
    claimable: int = Field(default=0, ge=0, description="Tasks an agent could claim now (not backing off, due).")
    oldest_claimable_since: datetime | None = Field(
        default=None, description="Since when the oldest claimable task has been claimable (its age in kubectl).")
    slots_held: int = Field(default=0, ge=0, description="Slot Leases held (with spec.maxRunning).")
    observed_generation: int = Field(default=0, ge=0)


NAME_PATTERN: Final = DNS_LABEL  # a TaskQueue is named as its queue

PRINTER_COLUMNS: Final[list[dict[str, Any]]] = [
    {"name": "Paused", "type": "boolean", "jsonPath": ".spec.paused"},
    {"name": "Max-Running", "type": "integer", "jsonPath": ".spec.maxRunning"},
    {"name": "Rate", "type": "number", "jsonPath": ".spec.claimsPerSecond"},
    {"name": "Running", "type": "integer", "jsonPath": ".status.running"},
    {"name": "Claimable", "type": "integer", "jsonPath": ".status.claimable"},
    {"name": "Pending", "type": "integer", "jsonPath": ".status.pending"},
    {"name": "Oldest-Claimable", "type": "date", "jsonPath": ".status.oldestClaimableSince"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {"name": "Succeeded", "type": "integer", "jsonPath": ".status.succeeded", "priority": 1},
    {"name": "Failed", "type": "integer", "jsonPath": ".status.failed", "priority": 1},
    {"name": "Slots", "type": "integer", "jsonPath": ".status.slotsHeld", "priority": 1},
]

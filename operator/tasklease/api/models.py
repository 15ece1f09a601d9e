"""The Task resource: pydantic models of its spec and status, the single source of truth.

The CRD's OpenAPI schema (`crds/tasks.tasklease.dev.yaml`) is generated from these
classes by `tasklease.api.crd`; a test fails when the checked-in file is stale. No I/O here.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from datetime import datetime
from typing import Annotated, Any, Final

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict

# Re-exported, so that models.GROUP and the like read naturally; their home is `resource`.
from tasklease.api import errors
from tasklease.api.resource import GROUP as GROUP
from tasklease.api.resource import KIND as KIND
from tasklease.api.resource import PLURAL as PLURAL
from tasklease.api.resource import VERSION as VERSION

MAX_RESULT_BYTES: Final = 8192
MAX_ERROR_CHARS: Final = 1024
MAX_HISTORY: Final = 10
# The API server accepts objects nested up to 10,000 levels; a payload deeper than this is
# refused by the claim rule and failed by the operator (reason InvalidPayload).
MAX_PAYLOAD_DEPTH: Final = 64
DNS_LABEL: Final = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_DNS_LABEL_RE: Final = re.compile(DNS_LABEL)


def is_namespace(value: object) -> bool:
    """A namespace's name: a DNS label of at most 63 characters. Checked before any request: a
    path built from another reaches no namespace, and the API server's 404 would blame the CRD."""
    return isinstance(value, str) and len(value) <= 63 and bool(_DNS_LABEL_RE.fullmatch(value))


# The outcome of an attempt that ran past its attemptTimeoutSeconds, and the reason of its Event.
ATTEMPT_TIMED_OUT: Final = "AttemptTimedOut"


class _Model(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown fields are refused."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class BackoffPolicy(enum.StrEnum):
    EXPONENTIAL = "Exponential"
    FIXED = "Fixed"


class Backoff(_Model):
    """How long a task waits before its next attempt after a failure or an expiry."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        {"rule": "self.maxSeconds >= self.initialSeconds",
         "message": "backoff.maxSeconds must be at least backoff.initialSeconds"},
    ]})

    policy: BackoffPolicy = Field(
        default=BackoffPolicy.EXPONENTIAL,
        description="Exponential doubles the delay after each attempt (initialSeconds, 2x, 4x, ... up to "
                    "maxSeconds); Fixed always waits initialSeconds.")
    initial_seconds: int = Field(default=5, ge=0, le=3600, description="Delay before the second attempt.")
    max_seconds: int = Field(default=300, ge=0, le=86400, description="Upper bound of any delay.")
    jitter: bool = Field(
        default=True,
        description="Wait a random time between half the delay and the whole of it (equal jitter), so that "
                    "tasks failed together (an outage) do not all come back at the same moment. False: "
                    "exactly the delay.")

    def delay_after(self, attempt: int) -> int:
        """The delay before the attempt that follows `attempt` (1-based), before jitter: the
        longest wait `jittered` may choose."""
        if self.policy is BackoffPolicy.FIXED:
            return min(self.initial_seconds, self.max_seconds)
        return int(min(self.initial_seconds * 2 ** max(attempt - 1, 0), self.max_seconds))

    def jittered(self, attempt: int, rand: Callable[[], float]) -> float:
        """Seconds to wait before the attempt that follows `attempt`: with `jitter`, uniform in
        [delay/2, delay] drawn with `rand` (uniform in [0, 1), injected so tests pin it)."""
        delay = self.delay_after(attempt)
        return delay / 2 + rand() * delay / 2 if self.jitter else float(delay)


# A time the API server's date-time format takes and no reader can (the year 0000, or a year
# 10000 once in UTC): refused where the Task is written, not skipped where it is read.
_TIME_IN_RANGE: Final[JsonDict] = {"x-kubernetes-validations": [
    {"rule": "self >= timestamp('0001-01-01T00:00:00Z') && self <= timestamp('9999-12-31T23:59:59Z')",
     "message": "must be a time in the years 1 to 9999, in UTC"}]}


class TaskSpec(_Model):
    """What to do, and the rules for its attempts."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        {"rule": "self.queue == oldSelf.queue", "message": "spec.queue is immutable"},
        {"rule": "self.payload == oldSelf.payload", "message": "spec.payload is immutable"},
        {"rule": "!oldSelf.cancel || self.cancel",
         "message": "spec.cancel cannot be undone once set"},
    ]})

    queue: str = Field(
        min_length=1, max_length=63, pattern=DNS_LABEL,
        description="The queue agents take this task from: a DNS label (lowercase letters, digits, '-').")
    payload: dict[str, Any] = Field(
        default_factory=dict, json_schema_extra={"default": {}},
        description="Free-form input handed to the agent as JSON.")
    priority: int = Field(
        default=0, ge=-1000, le=1000, description="Higher runs first; ties go to the oldest task.")
    max_attempts: int = Field(
        default=3, ge=1, le=100,
        description="Claims allowed before the task is dead-lettered (phase Failed, reason DeadLettered).")
    lease_duration_seconds: int = Field(
        default=30, ge=5, le=3600,
        description="How long a holder may go without renewing before its attempt is expired.")
    backoff: Backoff = Field(default_factory=Backoff,
                             json_schema_extra={"default": Backoff().model_dump(mode="json", by_alias=True)},
                             description="Delay between attempts.")
    deadline: datetime | None = Field(
        default=None, json_schema_extra=_TIME_IN_RANGE,
        description="RFC 3339 time after which no new attempt starts; an unfinished task then fails with "
                    "reason DeadlineExceeded.")
    cancel: bool = Field(
        default=False,
        description="Set to true to cancel: the current holder loses its lease and the task ends Cancelled.")
    not_before: datetime | None = Field(
        default=None, json_schema_extra=_TIME_IN_RANGE,
        description="RFC 3339 time before which no attempt starts (a delayed start); backoff never ends "
                    "earlier than this either.")
    attempt_timeout_seconds: int | None = Field(
        default=None, ge=1, le=604800,
        description="Longest an attempt may run, from its claim as the operator observed it: then the operator "
                    "ends it as a failure with reason AttemptTimedOut (retried with backoff, counted against "
                    "maxAttempts) and its holder loses the lease. Default: the operator's "
                    "--attempt-timeout (none: only the lease and spec.deadline bound an attempt).")
    ttl_seconds_after_finished: int | None = Field(
        default=None, ge=0,
        description="Seconds after the task finished (Succeeded, Failed or Cancelled) when the operator "
                    "deletes it and its Lease. Dead-lettered tasks are kept until retried or deleted. "
                    "Default: the operator's --ttl-seconds-after-finished (none: kept).")


# What `TaskSpec.queue` accepts, judged by its own field (its bounds and pattern, stated once).
_QUEUE_NAME: Final = TypeAdapter(Annotated[(str, *TaskSpec.model_fields["queue"].metadata)])


def check_queue(queue: object) -> str:
    """`queue` if it can name a queue (what `TaskSpec.queue` accepts); else Invalid: a queue no
    task can be in would be waited on for ever."""
    try:
        return _QUEUE_NAME.validate_python(queue, strict=True)
    except ValidationError:
        raise errors.Invalid(f"not a queue name: {queue!r} (a DNS label: lowercase letters, digits and '-', "
                             "at most 63 characters)") from None


def payload_depth(value: Any) -> int:
    """How deeply `value` nests objects and arrays (a scalar is 0), without recursing: a
    payload nested thousands of levels deep must not take down whoever measures it."""
    depth = 0
    level: list[Any] = [value]
    while level:
        containers = [v for v in level if isinstance(v, dict | list)]
        if not containers:
            break
        depth += 1
        level = [c for v in containers for c in (v.values() if isinstance(v, dict) else v)]
    return depth


class Phase(enum.StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    CANCELLED = "Cancelled"

    @property
    def terminal(self) -> bool:
        return self in (Phase.SUCCEEDED, Phase.FAILED, Phase.CANCELLED)


TERMINAL_PHASES: Final = tuple(p.value for p in Phase if p.terminal)


class Attempt(_Model):
    """One attempt's story, newest last in status.history."""

    attempt: int = Field(ge=1)
    holder: str = Field(max_length=512)
    claimed_at: datetime | None = None
    ended_at: datetime | None = None
    outcome: str = Field(
        default="", max_length=64,
        description="Succeeded, Failed, Expired, AttemptTimedOut, Released, Requeued or Cancelled; empty while "
                    "running.")
    message: str = Field(default="", max_length=MAX_ERROR_CHARS)


class TaskStatus(_Model):
    """A projection of the task's Lease, written by the operator; the Lease is the truth."""

    phase: Phase = Field(default=Phase.PENDING, description="Pending, Running, Succeeded, Failed or Cancelled.")
    reason: str = Field(default="", max_length=64,
                        description="Why the phase is what it is, e.g. DeadLettered, Expired, BackingOff.")
    holder: str = Field(default="", max_length=512,
                        description="The agent holding the lease: <pod>/<instance>[@<pod uid, first 8 characters>].")
    attempt: int = Field(default=0, ge=0, description="The current attempt: the fencing epoch of its claim.")
    claimed_at: datetime | None = None
    completed_at: datetime | None = None
    not_before: datetime | None = Field(default=None, description="No attempt starts before this time (backoff).")
    result: str = Field(default="", max_length=MAX_RESULT_BYTES, description="What the last holder reported.")
    last_error: str = Field(default="", max_length=MAX_ERROR_CHARS)
    history: list[Attempt] = Field(default_factory=list, max_length=MAX_HISTORY)
    observed_generation: int = Field(default=0, ge=0)


PRINTER_COLUMNS: Final = [
    {"name": "Queue", "type": "string", "jsonPath": ".spec.queue"},
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Holder", "type": "string", "jsonPath": ".status.holder"},
    {"name": "Attempt", "type": "integer", "jsonPath": ".status.attempt"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {"name": "Not-Before", "type": "string", "jsonPath": ".spec.notBefore"},
    {"name": "Priority", "type": "integer", "jsonPath": ".spec.priority", "priority": 1},
    {"name": "Max", "type": "integer", "jsonPath": ".spec.maxAttempts", "priority": 1},
    {"name": "Timeout", "type": "integer", "jsonPath": ".spec.attemptTimeoutSeconds", "priority": 1},
    {"name": "Reason", "type": "string", "jsonPath": ".status.reason", "priority": 1},
    {"name": "Error", "type": "string", "jsonPath": ".status.lastError", "priority": 1},
]

# Server-side field selectors: agents watch only their queue.
SELECTABLE_FIELDS: Final = [{"jsonPath": ".spec.queue"}, {"jsonPath": ".status.phase"}]

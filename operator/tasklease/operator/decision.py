"""What the operator does about one task: a pure function of what it observed, the time and its settings.

`decide` takes the Task (`TaskView`), its Lease (`LeaseRecord`), what the operator's own
clocks observed of that Lease (`Observed`), the time (`Now`) and the settings, and returns
the one protocol write to make (an `Action`, or None); `next_look` says when to look again
without an event. No I/O and no clock of its own here: the reconciler reads the store,
calls these and carries out the answer; tests call them on made-up times in milliseconds.

A new source of decisions (another controller's rule) plugs in the same way: a pure
function of (record, `Now`, settings) returning its write and its next look, called by the
reconciler with a snapshot taken from the store.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from tasklease.api import timestamps
from tasklease.api.models import Phase
from tasklease.operator import timeouts
from tasklease.protocol import LeaseRecord, TaskView, record
from tasklease.protocol.rules import Blocker, blocker, epochs_spent, invalid_payload

# How far a claim's sighting may precede the time it became claimable, or a holder's
# not-before may differ from ours, before we act: watch latency, not clock skew.
SLACK = timedelta(seconds=2)
# Outcomes of a holder's own write that end an attempt with the Task's backoff.
_BACKED_OFF = ("Failed",)


@dataclass(frozen=True, slots=True)
class Sighting:
    """When we first saw a Lease in its current (epoch, state), by the API server's clock:
    what a claim's timeliness and a backoff's end are judged from, never the writer's times.
    `witnessed`: we saw the attempt end (held, then this), not just found it so."""

    epoch: int
    state: str
    at: datetime
    witnessed: bool = False


@dataclass(frozen=True, slots=True)
class Observed:
    """What the operator's own clocks saw of a task's Lease (monotonic seconds)."""

    sighting: Sighting | None = None
    held_since: float | None = None  # when this held version was first seen; None if not held or another version
    silent_s: float = 0.0  # how long the held version we last saw has stood unchanged
    attempt_since: float | None = None  # when this attempt's claim was first seen
    duration_s: int = 0  # the longest lease duration the Task had while we saw this attempt
    pod_gone: bool = False  # the holder's own Pod went away
    # Leases of this name seen to go (deleted, or unlabelled) while its Task was known, and none
    # since: (owner uid, the highest epoch it showed). Another task's (forged, older) count 0.
    gone: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class Now:
    wall: datetime  # the API server's time, as the agents judge it
    mono: float  # the operator's monotonic clock


@dataclass(frozen=True, slots=True)
class Settings:
    grace_s: float
    attempt_timeout_s: int | None = None  # for Tasks without spec.attemptTimeoutSeconds
    rand: Callable[[], float] = lambda: 0.5  # the jitter of a backoff the operator puts right


@dataclass(frozen=True, slots=True)
class Close:
    """End the task for good (cancel, invalid payload, deadline, spent budget)."""

    phase: Phase
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class Reschedule:
    """Put right the end of a failed attempt's backoff."""

    not_before: datetime


@dataclass(frozen=True, slots=True)
class Undo:
    """Undo a claim seen before the task was claimable."""

    why: str
    not_before: datetime


@dataclass(frozen=True, slots=True)
class Expire:
    """Free a lease whose holder went silent or whose Pod is gone."""

    cause: str  # "timeout" | "pod-gone"
    silent_s: float


@dataclass(frozen=True, slots=True)
class TimeOut:
    """End an attempt that ran past its attempt timeout."""

    ran_s: float


@dataclass(frozen=True, slots=True)
class Free:
    """Give a claimable task with no Lease a free one, at the highest epoch remembered (its
    status, its own Lease that went): the agents count a task claimed before, or one whose
    claim they lost to a forged Lease, as taken until they see its Lease free."""

    epoch: int
    why: str


Action = Close | Reschedule | Undo | Expire | TimeOut | Free


def decide(view: TaskView, rec: LeaseRecord | None, seen: Observed, now: Now, settings: Settings) -> Action | None:
    """At most one write; what to do follows from why the task is not claimable
    (`rules.blocker`, the agents' own rule)."""
    found = blocker(view, rec, now.wall)
    if found is Blocker.CANCELLED:
        return Close(Phase.CANCELLED, "Cancelled", "cancelled on request (spec.cancel)")
    if found is Blocker.INVALID_PAYLOAD:
        return Close(Phase.FAILED, "InvalidPayload", invalid_payload(view.spec))
    if found is Blocker.PAST_DEADLINE:
        assert view.spec.deadline is not None
        return Close(Phase.FAILED, "DeadlineExceeded", f"deadline {view.spec.deadline.isoformat()} passed")
    if found is Blocker.SPENT:
        # maxAttempts was lowered below the attempts already made, no fencing epoch is left, or
        # the status remembers more attempts than maxAttempts with no Lease (deleted, or the
        # status written by hand): nobody may claim it again, and nobody else would tell.
        if epochs_spent(view, rec):
            return Close(Phase.FAILED, "DeadLettered", f"no attempt is left: its epoch reached {record.MAX_EPOCH}")
        if rec is None:
            return Close(Phase.FAILED, "DeadLettered", f"all {view.spec.max_attempts} attempts are spent: its status "
                         f"shows attempt {view.status_attempt} and it has no Lease")
        return Close(Phase.FAILED, "DeadLettered", f"all {view.spec.max_attempts} attempts are spent")
    if rec is None:
        if found is not None or not (view.status_attempt or seen.gone):
            return None  # a task never claimed needs no Lease to be claimed
        own = max((epoch for uid, epoch in seen.gone if uid == view.uid), default=None)
        why = (f"its Lease (attempt {own}) went" if own is not None else
               f"its status shows attempt {view.status_attempt} and it has no Lease" if view.status_attempt else
               "a Lease of another task by its name went")
        return Free(max(view.status_attempt, own or 0), why)
    sighting = seen.sighting
    if rec.state == record.FREE and sighting is not None and sighting.state == record.FREE:
        end = backoff_end(view, rec, sighting, settings.rand)
        if end is not None:
            return Reschedule(end)
    if rec.state != record.HELD or found not in (Blocker.HELD, Blocker.SCHEDULED):
        return None  # claimable, backing off, or finished for good (I4)
    early = _early(view, rec, sighting)
    if early is not None:
        return Undo(*early)
    timed_out = seen.held_since is not None and now.mono >= seen.held_since + _duration(view, seen) + settings.grace_s
    if seen.pod_gone or timed_out:
        return Expire("pod-gone" if seen.pod_gone else "timeout", seen.silent_s)
    limit = timeouts.limit_s(view.spec, settings.attempt_timeout_s)
    if limit is not None and seen.attempt_since is not None and now.mono >= seen.attempt_since + limit:
        return TimeOut(now.mono - seen.attempt_since)
    return None


def _duration(view: TaskView, seen: Observed) -> int:
    """How long a held version may stand unchanged: the Task's lease duration, but never less
    than the one it had while we saw this attempt (its holder renews by the one it claimed
    with: a duration lowered meanwhile applies from the next attempt)."""
    return max(view.spec.lease_duration_seconds, seen.duration_s)


def backoff_end(view: TaskView, rec: LeaseRecord, sighting: Sighting, rand: Callable[[], float]) -> datetime | None:
    """The end of a free Lease's backoff by our clock, when the one it says lies outside the
    Task's (jittered) backoff window by more than `SLACK`; None when it is inside. The holder
    that failed wrote not-before with its clock: we measure the Task's backoff from when we
    saw the attempt end. Any other free Lease (found free, not seeing the attempt end; or
    freed without a failure of its attempt, as a release is) keeps its not-before, but no
    later than a backoff from when we saw it free: whoever wrote it, no writer puts a task
    off for longer."""
    if sighting.epoch != rec.epoch:
        return None
    last = rec.history[-1] if rec.history else None
    failed = last is not None and last.attempt == rec.epoch and last.outcome in _BACKED_OFF
    backoff, attempt = view.spec.backoff, rec.epoch - rec.budget_from

    def end(draw: Callable[[], float]) -> datetime:
        at = sighting.at + timedelta(seconds=backoff.jittered(attempt, draw))
        return max(at, view.spec.not_before) if view.spec.not_before is not None else at
    earliest, latest = end(lambda: 0.0), end(lambda: 1.0)
    if not (failed and sighting.witnessed):
        if rec.not_before is None or rec.not_before <= latest + SLACK:
            return None
    elif rec.not_before is not None and earliest - SLACK <= rec.not_before <= latest + SLACK:
        return None
    return end(rand)


def _early(view: TaskView, rec: LeaseRecord, sighting: Sighting | None) -> tuple[str, datetime] | None:
    """(why, when it may start) when the claim that `rec` holds was first seen (by the
    API server's clock) before its task was claimable: before spec.notBefore."""
    if sighting is None or (sighting.epoch, sighting.state) != (rec.epoch, record.HELD):
        return None
    start = view.spec.not_before
    if start is not None and sighting.at + SLACK < start:
        return f"claimed before spec.notBefore {timestamps.format_time(start)}", start
    return None


def next_look(view: TaskView, rec: LeaseRecord | None, seen: Observed, now: Now, settings: Settings, *,
              delete_at: datetime | None) -> float | None:
    """When (monotonic) this task needs a look without any event: a delayed start or a backoff
    ends (its projection says so, and wakes waiting agents), a TTL runs out (`delete_at`), a
    held lease would expire, an attempt would time out, a deadline passes. None: only an event
    brings it back."""
    wakes: list[float] = []
    open_ = rec is None or rec.state != record.CLOSED
    backing_off_until = rec.not_before if rec is not None and rec.state == record.FREE else None
    for when in (view.spec.not_before if open_ else None, delete_at, backing_off_until):
        if when is not None and when > now.wall:
            wakes.append(now.mono + (when - now.wall).total_seconds())
    if rec is not None and rec.state == record.HELD:
        if seen.held_since is not None:
            wakes.append(seen.held_since + _duration(view, seen) + settings.grace_s)
        limit = timeouts.limit_s(view.spec, settings.attempt_timeout_s)
        if limit is not None and seen.attempt_since is not None:
            wakes.append(seen.attempt_since + limit)
    if view.spec.deadline is not None and open_:
        wakes.append(now.mono + max((view.spec.deadline - now.wall).total_seconds(), 0.0))
    return min(wakes, default=None)

"""Attempt timeouts: how long an attempt has run, on the operator's own monotonic clock.

A live holder whose work is stuck keeps renewing, so lease expiry never ends it. Each
attempt may run `spec.attemptTimeoutSeconds` (default: the operator's
`--attempt-timeout`), counted from the moment the operator first saw the claim (a new
epoch held), never from the Lease's `acquireTime` or `renewTime`, which the holder writes
with its own clock. An operator that starts (or restarts) has seen no claim yet, so every
running attempt gets a whole timeout from then: late, never early. A standby keeps its
sightings: it watched the same claims.

The ending itself is `Protocol.time_out`, a retryable failure with outcome AttemptTimedOut,
conditional on the Lease version the reconciler saw like an expiry; the projection posts
its Event and its holder hears of it from its watch of the Task (`agent/cancel.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

from tasklease.api import models
from tasklease.operator import metrics
from tasklease.operator.expiry import Monotonic
from tasklease.protocol import LeaseRecord, Protocol, TaskView

log = logging.getLogger("tasklease.operator")
K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Sighting:
    epoch: int
    first_seen: float  # on the operator's monotonic clock
    # The longest spec.leaseDurationSeconds the Task had while we saw this attempt: its holder
    # renews by the one it claimed with, so a duration lowered meanwhile applies from the next.
    duration_s: int = 0


def limit_s(spec: models.TaskSpec, default_s: int | None) -> int | None:
    """The attempt timeout that applies to a task: its own, else the operator's default."""
    return spec.attempt_timeout_seconds if spec.attempt_timeout_seconds is not None else default_s


class AttemptClock(Generic[K]):
    """Per held lease: which attempt (epoch) we saw claimed, and since when."""

    def __init__(self, monotonic: Monotonic) -> None:
        self.monotonic = monotonic
        self._seen: dict[K, Sighting] = {}

    def observe(self, key: K, rec: LeaseRecord) -> None:
        """Record a Lease version: a held one starts its attempt's clock (once per epoch); any
        other state stops it."""
        if not rec.holder or rec.outcome:
            self._seen.pop(key, None)
        elif (seen := self._seen.get(key)) is None or seen.epoch != rec.epoch:
            self._seen[key] = Sighting(rec.epoch, self.monotonic())

    def note_duration(self, key: K, epoch: int, duration_s: int) -> None:
        """The Task's lease duration, as a reconcile of attempt `epoch` read it."""
        seen = self._seen.get(key)
        if seen is not None and seen.epoch == epoch and duration_s > seen.duration_s:
            self._seen[key] = replace(seen, duration_s=duration_s)

    def forget(self, key: K) -> None:
        self._seen.pop(key, None)

    def sighting(self, key: K) -> Sighting | None:
        """Which attempt of `key` we saw claimed, and since when; None if none runs."""
        return self._seen.get(key)


def time_out(protocol: Protocol, view: TaskView, rec: LeaseRecord, ran_s: float,
             default_s: int | None) -> LeaseRecord:
    """End the attempt `rec` holds as AttemptTimedOut (one conditional write), count it, log it."""
    limit = limit_s(view.spec, default_s)
    origin = "spec.attemptTimeoutSeconds" if view.spec.attempt_timeout_seconds is not None else "--attempt-timeout"
    message = f"ran {ran_s:.1f}s, past its attempt timeout of {limit}s ({origin})"
    written = protocol.time_out(view, rec, message)
    metrics.ATTEMPT_TIMEOUTS.labels(view.namespace, view.spec.queue).inc()
    log.info("task %s/%s: attempt %d of %s timed out: %s", view.namespace, view.name, rec.epoch, rec.holder,
             message)
    return written

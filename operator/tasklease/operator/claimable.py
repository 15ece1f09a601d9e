"""Which Pending tasks an agent could claim now, by the operator's clock.

The input of `tasklease_claimable_tasks` and `tasklease_oldest_claimable_seconds`.

`tasklease_tasks{phase="Pending"}` also counts tasks backing off after a failed attempt and
tasks whose spec.notBefore is still ahead; an autoscaler wants only the tasks an agent
could start now. The rule is the agents' own (`rules.blocker`), asked for the moment the waits end, so a
backoff that ends between two events counts as soon as it ends, with no reconcile.

Only tasks that are not simply claimable since their creation are remembered (a Lease from
an earlier attempt, or a delayed start): a fresh backlog costs nothing here.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Generic, TypeVar

from tasklease.api import timestamps
from tasklease.protocol import LeaseRecord, TaskView
from tasklease.protocol.rules import blocker

K = TypeVar("K", bound=Hashable)
Where = tuple[str, str]  # (namespace, queue)


def waits_end(view: TaskView, rec: LeaseRecord | None) -> datetime | None:
    """When the last wait of `view` ends (its backoff, its delayed start); None without one."""
    return max((t for t in (view.spec.not_before, rec.not_before if rec is not None else None) if t is not None),
               default=None)


def claimable_by_waiting(view: TaskView, rec: LeaseRecord | None, now: datetime) -> bool:
    """Whether `view` may be claimed once its waits end (at once, when they have): not held,
    closed, cancelled, spent, or past its deadline by then."""
    end = waits_end(view, rec)
    return blocker(view, rec, now if end is None else max(now, end)) is None


@dataclass(slots=True)
class _Wait:
    ready: float  # epoch seconds from which it may be claimed (-inf: no wait); inf: not by waiting
    observed: float  # epoch seconds: its creation, or when this Lease version was first seen
    version: str  # the Lease's resourceVersion ("" without a Lease)


class Waits(Generic[K]):
    """The Pending tasks whose claimability is not simply "since creation". Not thread-safe:
    the caller's lock guards it, the one that guards its picture of the tasks."""

    def __init__(self) -> None:
        self._by_key: dict[K, _Wait] = {}

    def note(self, key: K, view: TaskView, rec: LeaseRecord | None, *, pending: bool, now: datetime) -> None:
        """Record `key` as just projected (`pending`: its phase is Pending)."""
        if not pending or (rec is None and view.spec.not_before is None):
            self._by_key.pop(key, None)
            return
        end = waits_end(view, rec)
        ready = math.inf if not claimable_by_waiting(view, rec, now) else -math.inf if end is None else end.timestamp()
        version = rec.resource_version if rec is not None else ""
        before = self._by_key.get(key)
        if before is not None and before.version == version:
            observed = before.observed
        elif rec is None:
            observed = (timestamps.parse_time(view.created) or now).timestamp()
        else:
            observed = now.timestamp()  # the attempt's end, as this operator saw it
        self._by_key[key] = _Wait(ready, observed, version)

    def forget(self, key: K) -> None:
        self._by_key.pop(key, None)

    def per_queue(self, queues: Iterable[Where], pending: Iterable[tuple[K, Where, str]],
                  now: datetime) -> list[tuple[str, str, int, float]]:
        """(namespace, queue, tasks claimable at `now`, seconds the oldest of them has been
        claimable) for every queue of `queues`; `pending` holds (key, where, creation time)
        of every Pending task."""
        t = now.timestamp()
        counts = dict.fromkeys(queues, 0)
        oldest = dict.fromkeys(counts, 0.0)
        for key, where, created in pending:
            wait = self._by_key.get(key)
            if wait is None:
                since = (timestamps.parse_time(created) or now).timestamp()
            elif wait.ready > t:
                continue
            else:
                since = max(wait.ready, wait.observed)
            counts[where] = counts.get(where, 0) + 1
            oldest[where] = max(oldest.get(where, 0.0), t - since)
        return [(ns, queue, counts[(ns, queue)], oldest[(ns, queue)]) for ns, queue in sorted(counts)]

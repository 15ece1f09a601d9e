"""When was a held lease's version first seen, on the operator's own monotonic clock? No I/O here.

Like client-go's leader election and the node lifecycle controller, the operator never
compares a remote `renewTime` with its local clock (clock skew, clock jumps: kubernetes
issues 67651, 125761). It remembers when it first saw each resourceVersion of a held
Lease; the lease is expired (`decision.decide`) when that version has stood unchanged for
the Task's `spec.leaseDurationSeconds + grace` seconds as measured here: never the Lease's
own `leaseDurationSeconds`, which its holder writes. A restarted operator has seen nothing
yet, so every held lease gets a full duration again.

`PodsGone` decides the other cause of expiry: the holder's own Pod went away.

`DeadlineQueue` is the one timer of the operator: a heap of (when, key) fed by watch
events, instead of one asyncio task or kopf timer per object.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

Monotonic = Callable[[], float]
K = TypeVar("K", bound=Hashable)
DEFAULT_GRACE_S = 2.0


@dataclass(frozen=True)
class Observation:
    resource_version: str
    first_seen: float  # on the operator's monotonic clock


class LeaseClock(Generic[K]):
    """Per held lease: which resourceVersion we saw, and since when."""

    def __init__(self, monotonic: Monotonic) -> None:
        self.monotonic = monotonic
        self._seen: dict[K, Observation] = {}

    def observe(self, key: K, resource_version: str) -> Observation:
        """Record a held lease's version; a version seen before keeps its first sighting."""
        seen = self._seen.get(key)
        if seen is None or seen.resource_version != resource_version:
            seen = Observation(resource_version, self.monotonic())
            self._seen[key] = seen
        return seen

    def forget(self, key: K) -> None:
        self._seen.pop(key, None)

    def seen(self, key: K) -> Observation | None:
        """The held version we last saw of `key`, and since when; None if none is held."""
        return self._seen.get(key)

    def silent_for(self, key: K) -> float:
        seen = self._seen.get(key)
        return 0.0 if seen is None else self.monotonic() - seen.first_seen

    def first_seen(self, key: K) -> float | None:
        """When the held version we last saw was first seen (monotonic); None if none is held."""
        seen = self._seen.get(key)
        return None if seen is None else seen.first_seen

    def restart_all(self) -> None:
        """Give every held lease a full duration from now (a new leader knows nothing)."""
        now = self.monotonic()
        self._seen = {k: Observation(o.resource_version, now) for k, o in self._seen.items()}


class PodsGone(Generic[K]):
    """Which Pods went away (deleted or terminated), for the pod-gone fast path: is a Lease's
    holder one of them?

    A holder that names its Pod's uid (`<pod>/<instance>@<uid>`, the uid's first characters)
    is judged by its pod and that uid, which a later Pod of the same name does not have: a
    StatefulSet's pod recreated under the same name is not taken for the one that went,
    whichever watch (Pods or Leases) tells us first. A holder without one is judged by time:
    only Lease versions first seen before its Pod's name went away are its."""

    def __init__(self, monotonic: Monotonic, *, memory_s: float) -> None:
        self.monotonic = monotonic
        self.memory_s = memory_s  # longer than any lease duration; then forgotten
        self._names: dict[K, float] = {}  # pod → when we last saw one of that name go
        self._uids: dict[tuple[K, str], float] = {}  # (pod, uid) → when we saw it go

    def gone(self, pod: K, uid: str) -> bool:
        """The Pod named `pod` with uid `uid` went away. True the first time we hear of it."""
        self._forget_old()
        if (pod, uid) in self._uids:
            return False
        self._uids[(pod, uid)] = self._names[pod] = self.monotonic()
        return True

    def alive(self, pod: K) -> None:
        """A Pod of this name runs: from now on, holders that name no uid are its."""
        self._forget_old()
        self._names.pop(pod, None)

    def took(self, pod: K, uid: str, *, first_seen: float) -> bool:
        """Is the holder of a Lease version first seen at `first_seen` (monotonic) gone with its Pod?"""
        if uid:
            return (pod, uid) in self._uids
        gone_at = self._names.get(pod)
        return gone_at is not None and first_seen <= gone_at

    def _forget_old(self) -> None:
        cutoff = self.monotonic() - self.memory_s
        self._names = {k: at for k, at in self._names.items() if at >= cutoff}
        self._uids = {k: at for k, at in self._uids.items() if at >= cutoff}


class DeadlineQueue(Generic[K]):
    """Keys to look at again at a given monotonic time. Stale entries are harmless: the
    reconciler decides from current state, so a wake-up that finds nothing to do is a no-op."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, K]] = []
        self._counter = itertools.count()
        self._scheduled: dict[K, float] = {}

    def schedule(self, key: K, when: float) -> None:
        if self._scheduled.get(key) == when:
            return
        self._scheduled[key] = when
        heapq.heappush(self._heap, (when, next(self._counter), key))

    def pop_due(self, now: float) -> list[K]:
        due: list[K] = []
        while self._heap and self._heap[0][0] <= now:
            when, _, key = heapq.heappop(self._heap)
            if self._scheduled.get(key) == when:
                del self._scheduled[key]
                due.append(key)
        return due

    def next_at(self) -> float | None:
        while self._heap and self._scheduled.get(self._heap[0][2]) != self._heap[0][0]:
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None

"""The operator's work queue, after controller-runtime's: which keys to reconcile, and when.

- A key is queued at most once (dedup) and handed to one worker at a time: a key that is
  queued again while a worker has it waits until that worker is `done` with it.
- `add_soon` opens a coalescing window at a key's first event; later events of the same
  window ride along, so a task claimed and finished within it gets one reconcile.
- `add_at` wakes a key at a monotonic time (one `DeadlineQueue`, no timer per key);
  `retry` does so after a per-key capped exponential backoff that `forget` resets.
- Idle workers are woken one at a time: by a key queued now, by a time earlier than every
  one they wait for, or by the worker before them, which wakes the next as it takes a key
  while others are queued or scheduled. One idle worker watches the clock; waking them all at
  every change woke every worker several times a task.

Thread-safe; the caller's clock is injected. No I/O here.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Hashable
from typing import Generic, TypeVar

from tasklease.api.retry import Backoff
from tasklease.operator.expiry import DeadlineQueue, Monotonic

K = TypeVar("K", bound=Hashable)
_RETRY_CAP_S = 30.0


class WorkQueue(Generic[K]):
    def __init__(self, monotonic: Monotonic, *, coalesce_s: float = 0.0, max_wait_s: float = 5.0) -> None:
        self.monotonic = monotonic
        self.coalesce_s = coalesce_s
        self.max_wait_s = max_wait_s  # the longest a `get` waits before it returns None
        self._cond = threading.Condition()
        self._pending: OrderedDict[K, None] = OrderedDict()
        self._soon: deque[tuple[float, K]] = deque()  # coalescing: (due, key), in due order
        self._coalescing: set[K] = set()
        self._inflight: set[K] = set()
        self._deadlines: DeadlineQueue[K] = DeadlineQueue()
        self._retries: dict[K, Backoff] = {}

    def add(self, key: K) -> None:
        """Queue `key` now."""
        with self._cond:
            self._pending[key] = None
            self._cond.notify()

    def add_soon(self, key: K) -> None:
        """Queue `key` at the end of the coalescing window its first event opens."""
        if self.coalesce_s <= 0:
            self.add(key)
            return
        with self._cond:
            if key not in self._pending and key not in self._coalescing:
                when = self.monotonic() + self.coalesce_s
                self._wake_if_first(when)
                self._coalescing.add(key)
                self._soon.append((when, key))

    def add_at(self, key: K, when: float) -> None:
        """Queue `key` at monotonic time `when` (its one wake-up: a later call replaces it)."""
        with self._cond:
            self._wake_if_first(when)
            self._deadlines.schedule(key, when)

    def retry(self, key: K, *, base_s: float) -> None:
        """Queue `key` again after its next backoff: `base_s`, doubling, capped."""
        with self._cond:
            backoff = self._retries.setdefault(key, Backoff(base_s=base_s, cap_s=_RETRY_CAP_S))
            when = self.monotonic() + backoff.next()
            self._wake_if_first(when)
            self._deadlines.schedule(key, when)

    def forget(self, key: K) -> None:
        """`key` went well: its next retry starts from the base again."""
        with self._cond:
            self._retries.pop(key, None)

    def get(self) -> K | None:
        """The next key due that no worker has, now marked as taken; None after waiting up to
        `max_wait_s` (or until something was queued) without one. Hand it back with `done`."""
        with self._cond:
            now = self.monotonic()
            for due in self._deadlines.pop_due(now):
                self._pending[due] = None
            while self._soon and self._soon[0][0] <= now:
                _, due = self._soon.popleft()
                self._coalescing.discard(due)
                self._pending[due] = None
            for key in self._pending:
                if key not in self._inflight:
                    del self._pending[key]
                    self._inflight.add(key)
                    if self._pending or self._earliest() is not None:
                        self._cond.notify()  # the next idle worker takes over (see the module)
                    return key
            nxt = self._earliest()
            wait = self.max_wait_s if nxt is None else min(max(nxt - self.monotonic(), 0.0), self.max_wait_s)
            self._cond.wait(wait)
            return None

    def done(self, key: K) -> None:
        """A worker has finished with `key`: if it was queued again meanwhile, it may be taken."""
        with self._cond:
            self._inflight.discard(key)
            if key in self._pending:
                self._cond.notify()

    def _earliest(self) -> float | None:
        """Caller holds the lock. The earliest time a key is scheduled or coalescing for."""
        return min((t for t in (self._deadlines.next_at(), self._soon[0][0] if self._soon else None)
                    if t is not None), default=None)

    def _wake_if_first(self, when: float) -> None:
        """Caller holds the lock. Wake an idle worker if `when` comes before every time the
        idle workers wait for."""
        earliest = self._earliest()
        if earliest is None or when < earliest:
            self._cond.notify()

    def queued(self, key: K) -> bool:
        """`key` is waiting for a worker or has one (not merely scheduled for later)."""
        with self._cond:
            return key in self._pending or key in self._inflight

    def waiting(self) -> int:
        """How many keys wait for a worker now."""
        with self._cond:
            return len(self._pending)

    def idle(self) -> bool:
        """No key waits for a worker or has one."""
        with self._cond:
            return not self._pending and not self._inflight

"""The watches of one queue's open Tasks that an agent keeps: the shards it views, and the tasks no shard holds.

Most tasks carry the default priority's rank and a shard (`protocol.labels`): an agent watches
those of the shards it views only (`division.viewers`), so a write to one of them reaches its
two viewers, not every agent of the queue. Every agent watches the rest: the tasks of another
priority (strict priority needs every band above the default one in view) and those without a
valid shard (created by hand). The three selections are disjoint and cover the queue.

When the agent's viewed shards change (a peer came or went), the shards gained are watched by
a watch of their own, listed at once; the tasks of shards lost leave the picture at once, and
their later events are ignored. A watch that selects shards no longer viewed is narrowed: a
watch of the shards still viewed takes over from the version up to which the old one told
everything (`Reflector.delivered`), with no list, so that no event of another agent's shard
reaches this one. Only a watch still listing cannot hand over: it is replaced by a watch that
lists its shards again once they are mostly others' (their events would cost more than that
list). Each task remembers the watch that told it last, so a task that moves between watches
(its labels changed) is neither lost nor kept twice.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection
from typing import Final

from tasklease.kube import JSON, TASKS, Kube
from tasklease.kube.watching import Listener, Reflector
from tasklease.protocol.labels import DEFAULT_RANK, LABEL_RANK, LABEL_SHARD, SHARDS, shard_label

_WIDE: Final = -1  # the watch of the other bands
_LOOSE: Final = -2  # the watch of the default band without a valid shard
_MOST_SHARD_WATCHES: Final = 4  # more, and one watch of every viewed shard replaces them
_ALL: Final = ",".join(map(str, range(SHARDS)))


class TaskWatches:
    """What a queue's Task watches tell, as one watch: `listener` hears every event of the
    tasks in view, `drop(names)` that tasks left the view without one (their shard did)."""

    def __init__(self, kube: Kube, *, namespace: str, queue: str, listener: Listener,
                 drop: Callable[[list[str]], None], field_selector: str, watch_field_selector: str,
                 batch_s: float) -> None:
        self._kube, self._namespace, self._batch_s = kube, namespace, batch_s
        self._selectors = (field_selector, watch_field_selector)
        self._listener = listener
        self._drop = drop
        self._lock = threading.Lock()
        self._told: dict[str, int] = {}  # name → the watch that told it last (a key of `_watches`)
        self._shard: dict[str, int] = {}  # name → its shard, for those told by a shard watch
        self._watches: dict[int, Reflector] = {
            _WIDE: self._make(_WIDE, f"{LABEL_RANK}!={DEFAULT_RANK}"),
            _LOOSE: self._make(_LOOSE, f"{LABEL_RANK}={DEFAULT_RANK},{LABEL_SHARD} notin ({_ALL})"),
        }
        self._by_shard: dict[int, int] = {}  # viewed shard → the key of the watch that lists it
        self._listing: dict[int, frozenset[int]] = {}  # a shard watch's key → the shards it selects
        self._next_key = 0
        self._first: list[Reflector] = []  # the watches started first: `synced` waits for them
        self._stopped = False
        self.synced = _AllSynced(self._first, threading.Event())

    @property
    def viewed(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._by_shard)

    def start(self, shards: Collection[int]) -> None:
        """Start watching, the shards `shards` among the sharded tasks."""
        with self._lock:
            self._view(frozenset(shards))
            self._first.extend(self._watches.values())
            started = list(self._watches.values())
        for r in started:
            r.start()
        self.synced.started.set()

    def view(self, shards: Collection[int]) -> None:
        """From now on, view `shards`: the tasks of those left leave the picture (`drop`), those
        gained are listed, and a watch that selects shards left is narrowed to those kept
        (see the module)."""
        viewed = frozenset(shards)
        with self._lock:
            if self._stopped or viewed == frozenset(self._by_shard):
                return
            lost = frozenset(self._by_shard) - viewed
            for shard in lost:
                del self._by_shard[shard]
            gone = [n for n, s in self._shard.items() if s in lost]
            for name in gone:
                del self._shard[name]
                del self._told[name]
            ended, started = [], []
            for key in [k for k in self._watches if k >= 0]:
                kept = frozenset(s for s, k in self._by_shard.items() if k == key)
                if kept == self._listing[key]:
                    continue
                since = self._watches[key].delivered
                if kept and since:
                    ended.append(self._end(key))
                    started.append(self._watch(kept, since=since))
                elif len(self._listing[key]) > 2 * len(kept):
                    ended.append(self._end(key))
                    for shard in kept:  # listed again below, their tasks kept meanwhile
                        del self._by_shard[shard]
            started += self._view(viewed)
            started = [r for r in started if r in self._watches.values()]  # not merged away by `_view`
        for r in ended:
            r.stop()
        if gone:
            self._drop(gone)
        for r in started:
            r.start()

    def _view(self, shards: frozenset[int]) -> list[Reflector]:
        """Caller holds the lock. Watch `shards` (a superset of those watched): the new
        shards by a new watch or, past `_MOST_SHARD_WATCHES`, all by one."""
        gained = shards - frozenset(self._by_shard)
        if not gained:
            return []
        sharded = [k for k in self._watches if k >= 0]
        if len(sharded) >= _MOST_SHARD_WATCHES:
            # One watch lists them all again; what it does not list was deleted meanwhile (`known`).
            for key in sharded:
                self._end(key).stop()
            gained = shards
        return [self._watch(gained)]

    def _watch(self, shards: frozenset[int], *, since: str = "") -> Reflector:
        """Caller holds the lock. A watch of `shards` that answers for them and their tasks from
        now on: it lists them, or it goes on `since` that version (the caller ends the watch
        that told them up to it)."""
        key = self._next_key
        self._next_key += 1
        for shard in shards:
            self._by_shard[shard] = key
        for name, shard in self._shard.items():
            if shard in shards:
                self._told[name] = key
        selector = f"{LABEL_RANK}={DEFAULT_RANK},{LABEL_SHARD} in ({','.join(map(str, sorted(shards)))})"
        self._watches[key] = self._make(key, selector, since=since)
        self._listing[key] = shards
        return self._watches[key]

    def _end(self, key: int) -> Reflector:
        """Caller holds the lock. Forget watch `key`; the caller stops it."""
        del self._listing[key]
        return self._watches.pop(key)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            watches = list(self._watches.values())
        for r in watches:
            r.stop()

    def shard(self, name: str) -> int | None:
        """The shard of task `name`, if a shard watch told it (else every agent watches it)."""
        with self._lock:
            return self._shard.get(name)

    def has(self, name: str) -> bool:
        with self._lock:
            return name in self._told

    def reflectors(self) -> list[Reflector]:
        """The watches under way (tools and tests relist them by hand)."""
        return self._current()

    def _make(self, key: int, labels: str, *, since: str = "") -> Reflector:
        return Reflector(self._kube, TASKS, namespace=self._namespace, field_selector=self._selectors[0],
                         watch_field_selector=self._selectors[1], label_selector=labels,
                         listener=lambda kind, obj: self._on(key, kind, obj), keep_objects=False,
                         known=lambda: self._told_by(key), knows=lambda name: self._tells(key, name),
                         watch_list=True, batch_s=self._batch_s, since=since)

    def _told_by(self, key: int) -> list[str]:
        with self._lock:
            return [n for n, k in self._told.items() if k == key]

    def _tells(self, key: int, name: str) -> bool:
        """`name in self._told_by(key)`, at every event of watch `key`: without the list."""
        with self._lock:
            return self._told.get(name) == key

    def _on(self, key: int, kind: str, obj: JSON) -> None:
        name = obj["metadata"]["name"]
        with self._lock:
            if key not in self._watches:
                return  # a watch stopped since: its shards are someone else's now
            if kind == "DELETED":
                if self._told.get(name) != key:
                    return  # never told, or moved to another of our watches, which told it already
                self._told.pop(name, None)
                self._shard.pop(name, None)
            else:
                shard = shard_label((obj["metadata"]).get("labels")) if key >= 0 else None
                if shard is not None and self._by_shard.get(shard) != key:
                    return  # a shard given up while this watch still lists it
                self._told[name] = key
                if shard is None:
                    self._shard.pop(name, None)
                else:
                    self._shard[name] = shard
        self._listener(kind, obj)

    # What the agent's bench and tests read of its task watch, summed over the watches.
    @property
    def synced_at(self) -> float | None:
        return self.synced.at()

    @property
    def pages(self) -> int:
        return sum(r.pages for r in self._current())

    @property
    def error(self) -> Exception | None:
        return next((r.error for r in self._current() if r.error is not None), None)

    @property
    def cut_short(self) -> int:
        return sum(r.cut_short for r in self._current())

    @property
    def retried(self) -> int:
        return sum(r.retried for r in self._current())

    def _current(self) -> list[Reflector]:
        with self._lock:
            return list(self._watches.values())


class _AllSynced:
    """Set once every watch started first has its first list (or was stopped before it)."""

    def __init__(self, watches: list[Reflector], started: threading.Event) -> None:
        self._watches = watches
        self.started = started

    def is_set(self) -> bool:
        return self.started.is_set() and all(r.synced.is_set() or r.stopped for r in list(self._watches))

    def wait(self, timeout: float | None = None) -> bool:
        """Like `threading.Event.wait`; a watch stopped before its list ends is looked at
        again every tenth of a second (its thread ends soon after)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.is_set():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            waiting = next((r for r in list(self._watches) if not (r.synced.is_set() or r.stopped)), None)
            (waiting.synced if waiting is not None else self.started).wait(0.1 if left is None else min(left, 0.1))
        return True

    def at(self) -> float | None:
        times = [r.synced_at for r in list(self._watches)]
        return None if not times or None in times else max(t for t in times if t is not None)

"""The candidate index: claimable task names by priority band, oldest first (pure, no I/O)."""

from __future__ import annotations

import bisect
import heapq
import sys


class CandidateIndex:
    """Claimable task names by priority band, oldest first within a band.

    One heap per band with lazy deletion: adding is O(log n), removing is O(1) (the entry
    goes stale and is dropped when it is next met). The band's best entries, once popped,
    stay out of its heap in a sorted prefix (every heap entry comes after them), so that
    the next look filters that prefix and pops only what was taken since: a look costs
    O(window) plus O(log n) per entry taken, not 2 · window heap operations."""

    def __init__(self) -> None:
        self._bands: dict[int, list[tuple[str, str]]] = {}  # priority → heap of (created, name)
        self._prefix: dict[int, list[tuple[str, str]]] = {}  # priority → its best entries, sorted
        self._priorities: list[int] = []  # ascending; the bands that may hold live entries
        self._members: dict[str, tuple[int, str]] = {}  # name → (priority, created) of its live entry

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, name: str) -> bool:
        return name in self._members

    def add(self, name: str, priority: int, created: str) -> bool:
        """True when `name` was not a candidate before."""
        before = self._members.get(name)
        if before == (priority, created):
            return False
        created = sys.intern(created)  # tasks created in the same second share it
        self._members[name] = (priority, created)
        band = self._bands.get(priority)
        if band is None:
            band = self._bands[priority] = []
            bisect.insort(self._priorities, priority)
        prefix = self._prefix.get(priority)
        if prefix and (created, name) < prefix[-1]:
            bisect.insort(prefix, (created, name))
        else:
            heapq.heappush(band, (created, name))
        if len(band) > 64 and len(band) > 4 * len(self._members):
            self._compact(priority)
        return before is None

    def discard(self, name: str) -> None:
        self._members.pop(name, None)

    def priority(self, name: str) -> int | None:
        entry = self._members.get(name)
        return entry[0] if entry else None

    def best(self, window: int) -> list[str]:
        """The `window` oldest candidates of the highest band that has any (strict priority)."""
        while self._priorities:
            priority = self._priorities[-1]
            band = self._bands[priority]
            found: list[tuple[str, str]] = []
            seen: set[str] = set()  # a task discarded and added again may have two entries
            for entry in self._prefix.get(priority, ()):
                if self._members.get(entry[1]) == (priority, entry[0]) and entry[1] not in seen:
                    found.append(entry)
                    seen.add(entry[1])
            while band and len(found) < window:
                entry = heapq.heappop(band)
                if self._members.get(entry[1]) == (priority, entry[0]) and entry[1] not in seen:
                    found.append(entry)
                    seen.add(entry[1])
            for entry in found[window:]:  # a deeper look's: back to the heap, the prefix stays short
                heapq.heappush(band, entry)
            if found:
                self._prefix[priority] = found[:window]
                return [name for _, name in found[:window]]
            del self._bands[priority]
            self._prefix.pop(priority, None)
            self._priorities.pop()
        return []

    def _compact(self, priority: int) -> None:
        band = [(created, name) for name, (p, created) in self._members.items() if p == priority]
        heapq.heapify(band)
        self._bands[priority] = band
        self._prefix.pop(priority, None)  # its live entries are in the heap again

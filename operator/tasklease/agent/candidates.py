"""The candidate index: claimable task names by priority band, oldest first (pure, no I/O)."""

from __future__ import annotations

import bisect
import heapq
import sys

Entry = tuple[str, str, int]  # (created, name, priority)


class CandidateIndex:
    """Claimable task names by priority band, oldest first within a band.

    One heap per band with lazy deletion: adding is O(log n), removing is O(1) (the entry
    goes stale and is dropped when it is next met). The band's best entries, once popped,
    stay out of its heap in a sorted prefix (every heap entry comes after them), so that
    the next look filters that prefix and pops only what was taken since: a look costs
    O(window) plus O(log n) per entry taken, not 2 · window heap operations."""

    def __init__(self) -> None:
        # An entry is (created, name, priority); names are unique, so entries order by age then
        # name. A task's live entry is the very tuple `_members` holds: one tuple per candidate.
        self._bands: dict[int, list[Entry]] = {}  # priority → heap of entries
        self._prefix: dict[int, list[Entry]] = {}  # priority → its best entries, sorted
        self._priorities: list[int] = []  # ascending; the bands that may hold live entries
        self._members: dict[str, Entry] = {}  # name → its live entry

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, name: str) -> bool:
        return name in self._members

    def add(self, name: str, priority: int, created: str) -> bool:
        """True when `name` was not a candidate before."""
        before = self._members.get(name)
        if before is not None and before[0] == created and before[2] == priority:
            return False
        entry = self._members[name] = (sys.intern(created), name, priority)  # one second's tasks share it
        band = self._bands.get(priority)
        if band is None:
            band = self._bands[priority] = []
            bisect.insort(self._priorities, priority)
        prefix = self._prefix.get(priority)
        if prefix and entry < prefix[-1]:
            bisect.insort(prefix, entry)
        else:
            heapq.heappush(band, entry)
        if len(band) > 64 and len(band) > 4 * len(self._members):
            self._compact(priority)
        return before is None

    def discard(self, name: str) -> None:
        self._members.pop(name, None)

    def priority(self, name: str) -> int | None:
        entry = self._members.get(name)
        return entry[2] if entry else None

    def best(self, window: int) -> list[str]:
        """The `window` oldest candidates of the highest band that has any (strict priority)."""
        while self._priorities:
            priority = self._priorities[-1]
            band = self._bands[priority]
            found: list[Entry] = []
            for entry in self._prefix.get(priority, ()):
                if self._members.get(entry[1]) is entry:
                    found.append(entry)
            while band and len(found) < window:
                entry = heapq.heappop(band)
                if self._members.get(entry[1]) is entry:
                    found.append(entry)
            for entry in found[window:]:  # a deeper look's: back to the heap, the prefix stays short
                heapq.heappush(band, entry)
            if found:
                self._prefix[priority] = found[:window]
                return [entry[1] for entry in found[:window]]
            del self._bands[priority]
            self._prefix.pop(priority, None)
            self._priorities.pop()
        return []

    def _compact(self, priority: int) -> None:
        band = [entry for entry in self._members.values() if entry[2] == priority]
        heapq.heapify(band)
        self._bands[priority] = band
        self._prefix.pop(priority, None)  # its live entries are in the heap again

"""The candidate index: claimable task names by priority band, oldest first (pure, no I/O)."""

from __future__ import annotations

import bisect


class _Bucket:
    """The candidates of one band created in the same second (the API server's resolution):
    a deep queue has far fewer of these than tasks, so a task costs the index a dict entry
    and a list slot, no object of its own."""

    __slots__ = ("created", "priority", "names", "live", "ordered")

    def __init__(self, created: str, priority: int) -> None:
        self.created = created
        self.priority = priority
        # Its names, with stale ones (discarded, or moved to another bucket) until next sorted:
        # a name is live here while the index maps it to this bucket.
        self.names: list[str] = []
        self.live = 0
        self.ordered = True  # `names` is sorted, without duplicates, since the last addition


class _Band:
    __slots__ = ("times", "buckets")

    def __init__(self) -> None:
        self.times: list[str] = []  # the creation times of its buckets, ascending
        self.buckets: dict[str, _Bucket] = {}


class CandidateIndex:
    """Claimable task names by priority band, oldest first within a band (then by name).

    Adding and removing are O(1) but for a new creation time (placed by bisection);
    removing leaves the name in its bucket's list, dropped when the bucket is next sorted or
    looked at. A look sorts the buckets it passes that changed since, and drops their stale
    names: it costs the size of the buckets it reads, not of the queue."""

    def __init__(self) -> None:
        self._members: dict[str, _Bucket] = {}  # name → the bucket it is live in
        self._bands: dict[int, _Band] = {}  # priority → its buckets; only bands with a live candidate
        self._priorities: list[int] = []  # ascending; the keys of `_bands`

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, name: str) -> bool:
        return name in self._members

    def add(self, name: str, priority: int, created: str) -> bool:
        """True when `name` was not a candidate before."""
        before = self._members.get(name)
        if before is not None:
            if before.created == created and before.priority == priority:
                return False
            self._leave(before)
        band = self._bands.get(priority)
        if band is None:
            band = self._bands[priority] = _Band()
            bisect.insort(self._priorities, priority)
        bucket = band.buckets.get(created)
        if bucket is None:
            bucket = band.buckets[created] = _Bucket(created, priority)
            bisect.insort(band.times, created)
        bucket.names.append(name)
        bucket.live += 1
        bucket.ordered = False
        self._members[name] = bucket
        if len(bucket.names) > 2 * bucket.live + 16:  # stale names of a bucket no look reaches
            self._tidy(bucket)
        return before is None

    def discard(self, name: str) -> None:
        bucket = self._members.pop(name, None)
        if bucket is not None:
            self._leave(bucket)

    def priority(self, name: str) -> int | None:
        bucket = self._members.get(name)
        return bucket.priority if bucket else None

    def best(self, window: int) -> list[str]:
        """The `window` oldest candidates of the highest band that has any (strict priority)."""
        if not self._priorities or window <= 0:
            return []
        band = self._bands[self._priorities[-1]]
        found: list[str] = []
        for created in band.times:
            bucket = band.buckets[created]
            if not bucket.ordered or len(bucket.names) > 2 * bucket.live:
                self._tidy(bucket)
            names, lead = bucket.names, 0
            while self._members.get(names[lead]) is not bucket:  # it has a live one
                lead += 1
            if lead:
                del names[:lead]  # what the claims took from its front is not passed again
            for name in names:
                if self._members.get(name) is bucket:
                    found.append(name)
                    if len(found) == window:
                        break
            if len(found) == window:
                break
        return found

    def _tidy(self, bucket: _Bucket) -> None:
        """Sort `bucket`'s names and drop its stale ones."""
        bucket.names = sorted({n for n in bucket.names if self._members.get(n) is bucket})
        bucket.ordered = True

    def _leave(self, bucket: _Bucket) -> None:
        """A name no longer live in `bucket` (the caller has moved it or dropped it)."""
        bucket.live -= 1
        if bucket.live:
            return
        band = self._bands[bucket.priority]
        del band.buckets[bucket.created]
        del band.times[bisect.bisect_left(band.times, bucket.created)]
        if not band.buckets:
            del self._bands[bucket.priority]
            del self._priorities[bisect.bisect_left(self._priorities, bucket.priority)]

"""The API server's time, estimated from the `Date` header of its answers.

Every decision that compares a time written on an object (a Task's `notBefore` and
`deadline`, a Lease's `not-before`) with "now" uses the API server's clock, so that a
process whose own clock is off still decides as everybody else does. The `Date` header
has whole seconds: an answer dated `D` was made while the server's clock read something
in [D, D + 1), at a moment between our sending the request (local `sent`) and reading
the answer (local `got`). So the offset (server minus local) lies in
[D - got, D + 1 - sent]. Answers narrow that interval; an interval that becomes empty
means a clock stepped, and the estimate starts again from the latest answer.

`earliest()` is the server time that surely has come (a lower bound), for "may this
start yet?" (an agent never claims early); `latest()` is an upper bound, for "did this
happen too early?" (the operator never undoes a claim that was on time).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime

Wall = Callable[[], datetime]


def _local() -> datetime:
    return datetime.now(UTC)


class ServerClock:
    """Bounds on (server time - local time), narrowed by every dated answer. Thread-safe."""

    def __init__(self, wall: Wall = _local) -> None:
        self.wall = wall
        self._lock = threading.Lock()
        self._low: timedelta | None = None
        self._high: timedelta | None = None

    def observe(self, date_header: str | None, *, sent: datetime, got: datetime) -> None:
        """Take in one answer's `Date` (ignored when absent or unreadable)."""
        if not date_header:
            return
        try:
            dated = parsedate_to_datetime(date_header)
        except (TypeError, ValueError):
            return
        if dated.tzinfo is None:
            dated = dated.replace(tzinfo=UTC)
        low, high = dated - got, dated + timedelta(seconds=1) - sent
        with self._lock:
            if self._low is None or self._high is None or low > self._high or high < self._low:
                self._low, self._high = low, high  # the first answer, or a clock stepped
            else:
                self._low, self._high = max(self._low, low), min(self._high, high)

    def offset(self) -> tuple[timedelta, timedelta]:
        """(low, high) bounds of server minus local; (0, 0) before any answer."""
        with self._lock:
            if self._low is None or self._high is None:
                return timedelta(0), timedelta(0)
            return self._low, self._high

    def earliest(self) -> datetime:
        """A server time that has surely come: decide "may it start now?" with this."""
        return self.wall() + self.offset()[0]

    def latest(self) -> datetime:
        """A server time not yet reached: decide "was that too early?" with this."""
        return self.wall() + self.offset()[1]

"""A monotonic clock for unit tests: it moves only when the test moves it (`clock.now += 3`)."""

from __future__ import annotations


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

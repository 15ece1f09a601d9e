"""Capped exponential backoff with jitter, and which errors are worth a retry. No I/O here.

Every retry loop (the watches, the operator's reconciler, `tasklease run --loop`) waits
with `Backoff`: base, 2x, 4x, ... up to a cap, each delay drawn from its upper half so
that many clients failing together do not retry together. Permanent errors (rights,
a missing CRD, a refused object) are not retried: the caller says so and stops.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from tasklease.api import errors

TRANSIENT: tuple[type[errors.TaskleaseError], ...] = (errors.Unreachable, errors.ServerError)


def transient(exc: BaseException) -> bool:
    """True for errors that may go away by themselves: the API server unreachable or overloaded."""
    return isinstance(exc, TRANSIENT)


@dataclass
class Backoff:
    """Delays for one retry loop: `next()` after a failure, `reset()` after a success."""

    base_s: float = 0.5
    cap_s: float = 30.0
    rng: random.Random = field(default_factory=random.Random)
    failures: int = 0
    # For a loop whose tries last (a watch): one that ran this long before it failed had
    # recovered, and `failed` starts the delays over (see there). None: only `reset` does.
    healthy_s: float | None = None

    def __post_init__(self) -> None:
        if not 0 < self.base_s <= self.cap_s:
            raise ValueError("need 0 < base_s <= cap_s")

    def next(self) -> float:
        """The wait before the next try: in [d/2, d] for d = min(cap, base x 2^failures)."""
        ceiling = min(self.cap_s, self.base_s * 2.0 ** min(self.failures, 64))
        self.failures += 1
        return ceiling / 2 + self.rng.uniform(0, ceiling / 2)

    def failed(self, ran_s: float) -> float:
        """`next()` after a try that ran `ran_s` before it failed. Without this, a watch that
        failed during one outage and then streamed for minutes would wait longer at the next
        outage, as if the two were one: up to the cap, long after the server is back."""
        if self.healthy_s is not None and ran_s >= self.healthy_s:
            self.reset()
        return self.next()

    def reset(self) -> None:
        self.failures = 0

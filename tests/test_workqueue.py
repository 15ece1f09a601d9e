"""The operator's work queue on an injected clock: dedup, one worker per key, coalescing, wake-ups, retry backoff."""

from __future__ import annotations

import pytest

from tasklease.operator.workqueue import WorkQueue

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def queue(clock: Clock, coalesce_s: float = 0.0) -> WorkQueue[str]:
    return WorkQueue(clock, coalesce_s=coalesce_s, max_wait_s=0.0)  # `get` never blocks here


def test_a_key_queued_twice_is_handed_out_once_in_order() -> None:
    q = queue(Clock())
    for key in ("a", "b", "a"):
        q.add(key)
    assert (q.get(), q.get(), q.get()) == ("a", "b", None)


def test_a_key_requeued_while_a_worker_has_it_waits_for_done() -> None:
    q = queue(Clock())
    q.add("a")
    assert q.get() == "a"
    q.add("a")
    assert q.get() is None and q.queued("a") and not q.idle()
    q.done("a")
    assert q.get() == "a"
    q.done("a")
    assert q.idle()


def test_events_within_a_coalescing_window_make_one_reconcile_at_its_end() -> None:
    clock = Clock()
    q = queue(clock, coalesce_s=0.5)
    q.add_soon("a")
    clock.t += 0.3
    q.add_soon("a")
    assert q.get() is None and not q.queued("a")
    clock.t += 0.2
    assert (q.get(), q.get()) == ("a", None)


def test_a_wake_up_comes_at_its_time_and_a_later_one_replaces_it() -> None:
    clock = Clock()
    q = queue(clock)
    q.add_at("a", 105.0)
    q.add_at("a", 110.0)
    clock.t = 109.9
    assert q.get() is None
    clock.t = 110.0
    assert q.get() == "a"


def test_retries_back_off_and_forget_starts_over() -> None:
    clock = Clock()
    q = queue(clock)

    def due_after() -> float:
        start = clock.t
        while q.get() is None:
            clock.t += 0.01
        q.done("a")
        return round(clock.t - start, 2)
    q.retry("a", base_s=0.2)
    first = due_after()
    q.retry("a", base_s=0.2)
    second = due_after()
    # Jittered within [d/2, d]: the first in [0.1, 0.2], the second in [0.2, 0.4].
    assert 0.1 <= first <= 0.21 and 0.19 <= second <= 0.41
    q.forget("a")
    q.retry("a", base_s=0.2)
    assert 0.1 <= due_after() <= 0.21

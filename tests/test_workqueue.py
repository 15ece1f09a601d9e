"""The operator's work queue: dedup, one worker per key, coalescing, wake-ups, retry backoff (an injected
clock; real worker threads where who is woken matters)."""

from __future__ import annotations

import threading
import time

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


def test_idle_workers_woken_one_at_a_time_still_take_every_key_when_it_is_due() -> None:
    """Four real worker threads, the real clock: keys queued now, at times to come, in
    coalescing windows and again while taken. None may wait for a worker's longest wait
    (30 s here): one woken too few shows as a key handed out seconds late."""
    q: WorkQueue[str] = WorkQueue(time.monotonic, coalesce_s=0.05, max_wait_s=30.0)
    due: dict[str, float] = {}
    late: dict[str, float] = {}
    taken: list[str] = []
    stop = threading.Event()

    def work() -> None:
        while not stop.is_set():
            key = q.get()
            if key is None:
                continue
            late[key] = max(late.get(key, 0.0), time.monotonic() - due[key])
            taken.append(key)
            time.sleep(0.01)  # a reconcile
            q.done(key)

    workers = [threading.Thread(target=work, daemon=True) for _ in range(4)]
    for w in workers:
        w.start()
    time.sleep(0.05)  # every worker idle, waiting
    start = time.monotonic()
    for i in range(12):  # the same moment for some, spread over 0.3 s for others
        due[f"at-{i}"] = start + (0.1 if i < 6 else 0.025 * i)
        q.add_at(f"at-{i}", due[f"at-{i}"])
    for i in range(8):
        due[f"now-{i}"] = time.monotonic()
        q.add(f"now-{i}")
        due[f"soon-{i}"] = time.monotonic() + 0.05
        q.add_soon(f"soon-{i}")
    deadline = time.monotonic() + 10
    while len(set(taken)) < len(due) and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    for i in range(4):
        q.add(f"stop-{i}")  # wake every worker to see `stop`
        due[f"stop-{i}"] = time.monotonic()
    for w in workers:
        w.join(5)
    assert set(taken) >= {k for k in due if not k.startswith("stop-")}
    assert max(v for k, v in late.items() if not k.startswith("stop-")) < 2.0, late


def test_keys_due_together_are_taken_by_the_idle_workers_together() -> None:
    """Each worker that takes a key wakes the next idle one while keys are left: four keys due
    at once go to four workers at once, not to the one that watched the clock, in turn."""
    q: WorkQueue[str] = WorkQueue(time.monotonic, max_wait_s=30.0)
    taken: dict[str, float] = {}
    stop = threading.Event()

    def work() -> None:
        while not stop.is_set():
            key = q.get()
            if key is not None:
                taken[key] = time.monotonic()
                time.sleep(0.3)  # a slow reconcile
                q.done(key)

    workers = [threading.Thread(target=work, daemon=True) for _ in range(4)]
    for w in workers:
        w.start()
    time.sleep(0.05)  # every worker idle, waiting
    due = time.monotonic() + 0.1
    for i in range(4):
        q.add_at(f"k-{i}", due)
    deadline = time.monotonic() + 10
    while len(taken) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    for i in range(4):
        q.add(f"stop-{i}")
    for w in workers:
        w.join(5)
    # In turn, the last would be taken 0.9 s late.
    assert max(taken[f"k-{i}"] for i in range(4)) - due < 0.6, {k: round(t - due, 3) for k, t in taken.items()}


@pytest.mark.parametrize("how", ["add", "add_soon", "add_at", "retry"])
def test_an_idle_worker_is_woken_for_the_first_key_however_it_is_queued(how: str) -> None:
    """Nothing queued or scheduled, one worker waiting its longest (30 s): a key queued any
    way is taken when it is due, not when that wait ends."""
    q: WorkQueue[str] = WorkQueue(time.monotonic, coalesce_s=0.05, max_wait_s=30.0)
    taken = threading.Event()

    def work() -> None:
        while q.get() is None:
            pass
        taken.set()

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    time.sleep(0.05)  # waiting
    if how == "add_at":
        q.add_at("k", time.monotonic() + 0.05)
    elif how == "retry":
        q.retry("k", base_s=0.05)
    else:
        getattr(q, how)("k")
    assert taken.wait(5), f"a key queued by {how} waited for the worker's longest wait"

"""Observed-time expiry and the operator's one timer, on an injected monotonic clock."""

from __future__ import annotations

from tasklease.operator.expiry import DeadlineQueue, LeaseClock


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_lease_expires_after_duration_plus_grace_of_one_unchanged_version() -> None:
    clock = Clock()
    leases: LeaseClock[str] = LeaseClock(clock, grace_s=2)
    leases.observe("t", "rv1", 10)
    clock.now += 11.9
    assert not leases.expired("t", "rv1")
    clock.now += 0.1
    assert leases.expired("t", "rv1")
    assert leases.silent_for("t") == 12.0
    assert leases.expires_at("t") == 112.0


def test_a_renewal_restarts_the_clock_and_an_old_version_never_expires() -> None:
    clock = Clock()
    leases: LeaseClock[str] = LeaseClock(clock, grace_s=0)
    leases.observe("t", "rv1", 10)
    clock.now += 9
    leases.observe("t", "rv2", 10)  # renewed: a new version, first seen now
    leases.observe("t", "rv2", 10)  # seen again (a relist): keeps its first sighting
    clock.now += 9
    assert not leases.expired("t", "rv2")
    assert not leases.expired("t", "rv1")  # what we decide on must be the version we last saw
    clock.now += 1
    assert leases.expired("t", "rv2")


def test_a_new_leader_gives_every_held_lease_a_full_duration() -> None:
    clock = Clock()
    leases: LeaseClock[str] = LeaseClock(clock, grace_s=0)
    leases.observe("t", "rv1", 10)
    clock.now += 9
    leases.restart_all()
    clock.now += 9
    assert not leases.expired("t", "rv1")
    leases.forget("t")
    assert leases.expires_at("t") is None and not leases.expired("t", "rv1")


def test_the_deadline_queue_keeps_only_the_latest_time_per_key() -> None:
    queue: DeadlineQueue[str] = DeadlineQueue()
    queue.schedule("a", 5.0)
    queue.schedule("b", 3.0)
    queue.schedule("a", 1.0)  # rescheduled earlier: the 5.0 entry is stale
    assert queue.next_at() == 1.0
    assert queue.pop_due(2.0) == ["a"]
    assert queue.next_at() == 3.0
    assert queue.pop_due(10.0) == ["b"]  # the stale "a" at 5.0 never fires
    assert queue.next_at() is None

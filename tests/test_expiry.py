"""Observed-time expiry and the operator's one timer, on an injected monotonic clock."""

from __future__ import annotations

import pytest

from tasklease.operator.expiry import DeadlineQueue, LeaseClock, Observation, PodsGone
from fake_clock import Clock

pytestmark = pytest.mark.unit  # pure logic: `make unit` runs it, on every Python


def test_a_held_version_is_timed_from_when_it_was_first_seen() -> None:
    clock = Clock()
    leases: LeaseClock[str] = LeaseClock(clock)
    leases.observe("t", "rv1")
    clock.now += 12
    assert leases.seen("t") == Observation("rv1", 100.0)
    assert leases.silent_for("t") == 12.0
    assert leases.first_seen("t") == 100.0
    assert leases.first_seen("other") is None and leases.seen("other") is None


def test_a_renewal_restarts_the_clock_and_a_version_seen_again_keeps_it() -> None:
    clock = Clock()
    leases: LeaseClock[str] = LeaseClock(clock)
    leases.observe("t", "rv1")
    clock.now += 9
    leases.observe("t", "rv2")  # renewed: a new version, first seen now
    clock.now += 9
    leases.observe("t", "rv2")  # seen again (a relist): keeps its first sighting
    assert leases.seen("t") == Observation("rv2", 109.0)


def test_a_new_leader_gives_every_held_lease_a_full_duration() -> None:
    clock = Clock()
    leases: LeaseClock[str] = LeaseClock(clock)
    leases.observe("t", "rv1")
    clock.now += 9
    leases.restart_all()
    assert leases.seen("t") == Observation("rv1", 109.0)
    leases.forget("t")
    assert leases.seen("t") is None


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


def test_a_holder_naming_its_pod_uid_is_gone_with_that_pod_only_whatever_arrives_first() -> None:
    clock = Clock()
    pods: PodsGone[str] = PodsGone(clock, memory_s=3600)
    claimed_by_new_pod = clock.now  # the new worker-0's claim is seen before the old one's deletion
    clock.now += 5
    assert pods.gone("worker-0", "uid-old")
    assert not pods.gone("worker-0", "uid-old")  # told twice (terminated, then deleted): once
    assert not pods.took("worker-0", "uid-new", first_seen=claimed_by_new_pod)
    assert pods.took("worker-0", "uid-old", first_seen=clock.now + 1)  # even a version seen later
    pods.alive("worker-0")  # the new pod shows up: the old one stays gone
    assert pods.took("worker-0", "uid-old", first_seen=clock.now)


def test_a_holder_without_a_pod_uid_is_gone_for_versions_seen_before_its_pods_name_went() -> None:
    clock = Clock()
    pods: PodsGone[str] = PodsGone(clock, memory_s=3600)
    seen_before = clock.now
    clock.now += 1
    assert pods.gone("worker-0", "uid-old")
    assert pods.took("worker-0", "", first_seen=seen_before)
    assert not pods.took("worker-0", "", first_seen=clock.now + 1)  # written later: a new namesake's
    pods.alive("worker-0")
    assert not pods.took("worker-0", "", first_seen=seen_before)  # a pod of that name runs again
    assert not pods.took("worker-1", "", first_seen=seen_before)


def test_gone_pods_are_forgotten_after_the_memory() -> None:
    clock = Clock()
    pods: PodsGone[str] = PodsGone(clock, memory_s=60)
    pods.gone("worker-0", "uid-old")
    clock.now += 61
    pods.gone("worker-1", "uid-other")  # any news prunes what is older than the memory
    assert not pods.took("worker-0", "uid-old", first_seen=0.0)
    assert pods.took("worker-1", "uid-other", first_seen=0.0)


def test_a_uid_is_judged_with_its_pods_name() -> None:
    clock = Clock()
    pods: PodsGone[str] = PodsGone(clock, memory_s=3600)
    pods.gone("worker-0", "0c5e6a1e")
    assert not pods.took("worker-1", "0c5e6a1e", first_seen=0.0)  # another pod whose uid starts alike

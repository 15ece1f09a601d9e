"""The operator's store on injected clocks: intake of watch events, stale versions, unreadable
objects, and the snapshot a decision is made from."""

from __future__ import annotations

import functools
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

pytest.importorskip("prometheus_client")  # the operator's extra: not on the SDK-only Pythons of `make unit-all`

from tasklease.api.models import Phase  # noqa: E402
from tasklease.kube import JSON, TASKS  # noqa: E402
from tasklease.kube.watching import Reflector  # noqa: E402
from tasklease.operator import metrics  # noqa: E402
from tasklease.operator.store import Key, Store  # noqa: E402
from tasklease.protocol import LeaseRecord, TaskView, record  # noqa: E402
from fake_clock import Clock

pytestmark = pytest.mark.unit

T0 = datetime(2030, 1, 1, tzinfo=UTC)
KEY = ("ns", "t")


def _lease_event(s: Store, kind: str, obj: JSON) -> Key | None:
    """A Lease event as the operator's watch hands it to the store: read once beforehand."""
    return s.lease_event(kind, obj, record.read(obj))


def store(clock: Clock) -> Store:
    return Store(monotonic=clock, clock=lambda: T0, late_clock=lambda: T0 + timedelta(seconds=1))


def task(rv: str, *, queue: str = "q", **spec: Any) -> JSON:
    return {"apiVersion": "tasklease.dev/v1alpha1", "kind": "Task",
            "metadata": {"name": "t", "namespace": "ns", "uid": "uid-t", "resourceVersion": rv, "generation": 1,
                         "creationTimestamp": "2029-12-31T23:59:00Z"},
            "spec": {"queue": queue, **spec}, "status": {}}


def lease(rv: str, *, holder: str = "", epoch: int = 0) -> JSON:
    return record.encode(LeaseRecord(name="t", namespace="ns", queue="q", owner_uid="uid-t", holder=holder,
                                     epoch=epoch, acquired_at=T0 if holder else None,
                                     renewed_at=T0 if holder else None, resource_version=rv))


def malformed(kind: str) -> float:
    return metrics.REGISTRY.get_sample_value("tasklease_malformed_objects_total",
                                             {"kind": kind, "reason": "unreadable"}) or 0.0


def held_rv(s: Store) -> str | None:
    _, kept = s.entry(KEY)
    return kept.resource_version if kept is not None else None


def test_added_modified_and_deleted_tasks_are_taken_in_and_each_names_its_key() -> None:
    s = store(Clock(1000.0))
    assert s.task_event("ADDED", task("5")) == KEY
    assert s.task(KEY) is not None and s.task(KEY).json()["spec"] == {"queue": "q"}  # type: ignore[union-attr]
    assert s.task_event("MODIFIED", task("6", cancel=True)) == KEY
    assert s.task(KEY).json()["spec"]["cancel"] is True  # type: ignore[union-attr]
    assert s.task_keys() == [KEY]
    assert s.task_event("DELETED", task("7", cancel=True)) == KEY
    assert s.task(KEY) is None and s.task_keys() == []


def test_an_older_task_version_is_ignored_and_queues_nothing_but_a_listed_one_is_looked_at() -> None:
    s = store(Clock(1000.0))
    s.task_event("ADDED", task("9", cancel=True))
    kept = s.task(KEY)
    assert s.task_event("MODIFIED", task("8")) is None  # replayed older news: nothing to look at
    assert s.task_event("ADDED", task("9", cancel=True)) is None  # the same version again (our write, a relist)
    assert s.listed_task(task("8")) == KEY  # a seeding list looks at every task, older or not
    assert s.task(KEY) is kept and kept is not None and kept.json()["spec"]["cancel"] is True


def test_a_deletion_is_applied_whatever_version_it_carries() -> None:
    s = store(Clock(1000.0))
    s.task_event("ADDED", task("9"))
    s.task_event("DELETED", task("3"))  # a relist's deletion carries the version last listed
    assert s.task(KEY) is None


def test_a_version_that_is_no_number_counts_as_newer() -> None:
    s = store(Clock(1000.0))
    s.task_event("ADDED", task("9"))
    s.task_event("MODIFIED", task("opaque", cancel=True))
    assert s.task(KEY).json()["spec"]["cancel"] is True  # type: ignore[union-attr]
    s.task_event("MODIFIED", task("2"))
    assert "cancel" not in s.task(KEY).json()["spec"]  # type: ignore[union-attr]


@pytest.mark.parametrize("obj", [{}, {"metadata": {"namespace": "ns"}}, {"metadata": {"namespace": "ns", "name": 7}},
                                 {"metadata": {"namespace": "ns", "name": "t"}, "spec": ["not", "a", "map"]}],
                         ids=["no-metadata", "no-name", "name-not-a-string", "spec-not-a-map"])
def test_a_task_that_cannot_be_read_is_skipped_and_counted(obj: JSON) -> None:
    s = store(Clock(1000.0))
    s.task_event("ADDED", task("5"))
    before = malformed("Task")
    assert s.task_event("MODIFIED", obj) is None
    assert malformed("Task") == before + 1
    assert s.task(KEY) is not None and s.task(KEY).version == 5  # type: ignore[union-attr]


def test_leases_are_taken_in_stale_versions_ignored_and_deletions_forget_them() -> None:
    clock = Clock(1000.0)
    s = store(clock)
    assert _lease_event(s, "ADDED", lease("10", holder="p/1", epoch=1)) == KEY
    clock.now += 3
    assert _lease_event(s, "MODIFIED", lease("11", holder="p/1", epoch=1)) == KEY
    assert held_rv(s) == "11"
    assert _lease_event(s, "MODIFIED", lease("10", holder="p/1", epoch=1)) is None  # older: nothing new
    assert held_rv(s) == "11"
    _, kept = s.entry(KEY)
    rec = kept.record() if kept is not None else None
    assert s.observed(KEY, rec).held_since == 1003.0  # the older version did not restart the clock
    assert _lease_event(s, "DELETED", lease("12", holder="p/1", epoch=1)) == KEY
    assert s.entry(KEY) == (None, None) and s.observed(KEY, rec).sighting is None


def test_a_lease_that_cannot_be_read_drops_the_one_held_and_is_counted() -> None:
    s = store(Clock(1000.0))
    _lease_event(s, "ADDED", lease("10", holder="p/1", epoch=1))
    unreadable = lease("11", holder="p/1", epoch=1)
    unreadable["spec"] = "not a map"
    before = malformed("Lease")
    assert _lease_event(s, "MODIFIED", unreadable) == KEY
    assert malformed("Lease") == before + 1
    assert s.entry(KEY) == (None, None)
    assert _lease_event(s, "MODIFIED", {"metadata": {}}) is None  # not even a name: skipped
    assert malformed("Lease") == before + 2


def test_the_snapshot_says_what_our_clocks_saw_of_the_held_version() -> None:
    clock = Clock(1000.0)
    s = store(clock)
    _lease_event(s, "ADDED", lease("10", holder="agent-0/i@abcdef12", epoch=1))
    clock.now += 4
    _, kept = s.entry(KEY)
    assert kept is not None
    rec = kept.record()
    seen = s.observed(KEY, rec)
    assert (seen.held_since, seen.silent_s, seen.attempt_since, seen.pod_gone) == (1000.0, 4.0, 1000.0, False)
    # A claim's sighting carries the API server's latest bound, by the store's late clock.
    assert seen.sighting is not None and (seen.sighting.epoch, seen.sighting.at) == (1, T0 + timedelta(seconds=1))
    s.restart_clocks()  # we start leading: every held lease gets a full duration from now
    assert s.observed(KEY, rec).held_since == 1004.0
    assert s.pod_event("DELETED", {"metadata": {"namespace": "ns", "name": "agent-0", "uid": "abcdef12-99"}}) == [KEY]
    assert s.observed(KEY, rec).pod_gone
    renewed = record.decode(lease("11", holder="agent-0/i@abcdef12", epoch=1))
    assert s.observed(KEY, renewed).held_since is None  # another version than the one held


def test_our_own_lease_write_is_kept_unless_the_watch_brought_a_newer_one() -> None:
    s = store(Clock(1000.0))
    _lease_event(s, "ADDED", lease("10", holder="p/1", epoch=1))
    before = record.decode(lease("10", holder="p/1", epoch=1))
    s.remember(before, record.decode(lease("12", epoch=1)))
    assert held_rv(s) == "12"
    _lease_event(s, "MODIFIED", lease("13", holder="q/1", epoch=2))  # the next claim
    s.remember(before, record.decode(lease("14", epoch=2)))
    assert held_rv(s) == "13"


def test_our_status_write_is_kept_unless_an_event_replaced_the_task_meanwhile() -> None:
    s = store(Clock(1000.0))
    s.task_event("ADDED", task("5"))
    entry = s.task(KEY)
    assert entry is not None
    s.wrote_task(KEY, entry, task("6"))
    assert s.task(KEY).version == 6  # type: ignore[union-attr]
    s.task_event("MODIFIED", task("7", cancel=True))
    s.wrote_task(KEY, entry, task("8"))  # written from `entry`, which the event replaced
    assert s.task(KEY).version == 7  # type: ignore[union-attr]


def _pending(s: Store) -> float | None:
    return metrics.REGISTRY.get_sample_value("tasklease_tasks", {"namespace": "ns", "queue": "gauged",
                                                                 "phase": "Pending"})


def test_a_projected_phase_is_counted_once_and_not_again_after_its_task_is_gone() -> None:
    s = store(Clock(1000.0))
    obj = task("5", queue="gauged")
    s.task_event("ADDED", obj)
    before = _pending(s) or 0.0
    s.projected(KEY, "gauged", TaskView.of(obj), None, phase=Phase.PENDING, now=T0)
    s.task_event("MODIFIED", task("6", queue="gauged"))  # a new version keeps what was projected
    assert _pending(s) == before + 1
    assert s.oldest_pending(T0) == [("ns", "gauged", 60.0)]
    s.task_event("DELETED", task("7", queue="gauged"))
    s.projected(KEY, "gauged", TaskView.of(obj), None, phase=Phase.PENDING, now=T0)  # a reconcile under way
    assert _pending(s) == before
    assert s.oldest_pending(T0) == [("ns", "gauged", 0.0)]


def test_a_malformed_lease_is_reported_once_per_attempt_and_kind_of_problem() -> None:
    s = store(Clock(1000.0))
    rec = record.decode(lease("10", holder="p/1", epoch=1))
    bad = replace(rec, malformed=("history",))
    assert s.first_report(bad) and not s.first_report(bad)
    assert s.first_report(replace(rec, malformed=("history", "outcome")))
    assert s.first_report(replace(rec, epoch=2, malformed=("history",)))  # the next attempt's is news again


def test_an_older_lease_version_that_cannot_be_read_leaves_the_newer_one_held() -> None:
    s = store(Clock(1000.0))
    _lease_event(s, "ADDED", lease("10", holder="p/1", epoch=1))
    older = lease("9", holder="p/1", epoch=1)
    older["spec"] = "not a map"
    _lease_event(s, "ADDED", older)  # a seeding list behind the watch
    assert held_rv(s) == "10"


def test_the_names_held_are_named_as_a_reflector_names_them_and_a_relist_finds_deletions_by_them() -> None:
    s = store(Clock(1000.0))
    s.task_event("ADDED", task("5"))
    _lease_event(s, "ADDED", lease("6"))
    s.task_event("ADDED", {**task("7"), "metadata": {**task("7")["metadata"], "namespace": "other"}})
    assert s.task_names("ns") == ["t"] and sorted(s.task_names(None)) == ["ns/t", "other/t"]
    assert s.lease_names("ns") == ["t"] and s.lease_names(None) == ["ns/t"] and s.lease_names("other") == []
    assert s.holds_task("ns", "t") and s.holds_task(None, "other/t") and not s.holds_task("ns", "other/t")
    assert s.holds_lease(None, "ns/t") and not s.holds_lease("other", "t") and not s.holds_lease(None, "t")

    class Empty:
        """A namespace whose Tasks are all gone; one is created meanwhile, after the list's
        snapshot, and the store learns of it from elsewhere (the leader's seeding list)."""

        def list_pages(self, res: Any, **_: Any) -> Any:
            s.listed_task({**task("10"), "metadata": {**task("10")["metadata"], "name": "new"}})
            yield {"metadata": {"resourceVersion": "9"}, "items": []}
    seen: list[tuple[str, JSON]] = []

    def listener(kind: str, obj: JSON) -> None:
        seen.append((kind, obj))
        s.task_event(kind, obj)
    listed: list[str | None] = []

    def known(namespace: str | None) -> list[str]:
        listed.append(namespace)
        return s.task_names(namespace)
    watch = Reflector(Empty(), TASKS, namespace="ns", listener=listener,  # type: ignore[arg-type]
                      known=functools.partial(known, "ns"), knows=functools.partial(s.holds_task, "ns"))
    watch._relist()
    assert seen == [("DELETED", {"metadata": {"name": "t", "namespace": "ns"}})]
    assert listed == ["ns"]  # once, as the list starts: a name it did not bring again is asked of `knows`
    assert s.task(KEY) is None and s.task_names(None) == ["other/t", "ns/new"] and watch.store == {}


@pytest.mark.parametrize("lease_first", [True, False], ids=["lease-listed-first", "task-first"])
def test_a_task_and_its_lease_share_one_key_through_every_version(lease_first: bool) -> None:
    s = store(Clock(1000.0))
    if lease_first:  # as a new leader seeds: the Leases are listed before the Tasks
        _lease_event(s, "ADDED", lease("4"))
    s.task_event("ADDED", task("5"))
    _lease_event(s, "MODIFIED", lease("6", holder="p/1", epoch=1))
    entry, held = s.entry(KEY)
    assert entry is not None and held is not None and entry.key is held.key == KEY
    s.wrote_task(KEY, entry, task("7"))
    s.remember(held.record(), record.decode(lease("8", epoch=1)))
    s.task_event("MODIFIED", task("9", cancel=True))
    later, kept = s.entry(KEY)
    assert later is not None and kept is not None and later.key is kept.key is entry.key
    assert s.task_keys()[0] is entry.key

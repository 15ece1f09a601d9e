"""The reconciler without a control plane: watch events become queued keys, and leadership
seeding runs on its own thread, before which nothing is decided (a fake Kube, injected clocks)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

pytest.importorskip("prometheus_client")  # the operator's extra: not on the SDK-only Pythons of `make unit-all`

from fake_kube import FakeKube  # noqa: E402
from tasklease.kube import JSON, LEASES, TASKS, Resource  # noqa: E402
from tasklease.operator.reconciler import Reconciler  # noqa: E402
from tasklease.protocol import LeaseRecord, labels, record  # noqa: E402
from fake_clock import Clock

pytestmark = pytest.mark.unit

NOW = datetime(2030, 1, 1, tzinfo=UTC)
KEY = ("ns", "t")
DEADLINE_S = 10.0  # a generous bound on a loaded machine; each wait ends as soon as it holds


class ListingKube(FakeKube):
    """Lists what it holds; a Lease list waits for `release`, and says which thread asked."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.listing = threading.Event()
        self.lister: threading.Thread | None = None
        self.task_lists = 0

    def list(self, res: Resource, *, namespace: str | None = None, all_namespaces: bool = False,
             label_selector: str = "", timeout: float = 30, **_: Any) -> JSON:
        self.lister = threading.current_thread()
        self.listing.set()
        assert self.release.wait(DEADLINE_S), "the test never released the list"
        return {"metadata": {"resourceVersion": str(self._rv)}, "items": self._items(res)}

    def list_pages(self, res: Resource, **_: Any) -> Iterator[JSON]:
        self.task_lists += 1
        yield {"metadata": {"resourceVersion": str(self._rv)}, "items": self._items(res)}

    def _items(self, res: Resource) -> list[JSON]:
        return [obj for (plural, _, _), obj in self.objects.items() if plural == res.plural]


def task(name: str = "t", **spec: Any) -> JSON:
    return {"apiVersion": "tasklease.dev/v1alpha1", "kind": "Task",
            "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "generation": 1,
                         "creationTimestamp": "2029-12-31T00:00:00Z"},
            "spec": {"queue": "q", **spec}, "status": {}}


def held_lease(name: str = "t", holder: str = "agent-0/1") -> JSON:
    return record.encode(LeaseRecord(name=name, namespace="ns", queue="q", owner_uid=f"uid-{name}", holder=holder,
                                     epoch=1, acquired_at=NOW, renewed_at=NOW))


def reconciler(kube: FakeKube, clock: Clock, **kw: Any) -> Reconciler:
    return Reconciler(kube, grace_s=1.0, clock=lambda: NOW, monotonic=clock, **kw)  # type: ignore[arg-type]


def drain(r: Reconciler) -> list[tuple[str, str]]:
    keys = []
    r.queue.max_wait_s = 0.0  # `get` never blocks here
    while (key := r.queue.get()) is not None:
        keys.append(key)
        r.queue.done(key)
    return keys


def until(condition: Any, message: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {message}"
        time.sleep(0.01)


# -- intake ----------------------------------------------------------------------------------


def test_each_watch_event_queues_its_tasks_key_once() -> None:
    kube = FakeKube()
    r = reconciler(kube, Clock(1000.0))
    r.on_task("ADDED", kube.put(TASKS, task()))
    event = kube.put(LEASES, held_lease())
    r.on_lease("ADDED", event, record.read(event))
    r.on_task("ADDED", kube.put(TASKS, task("u")))
    assert drain(r) == [KEY, ("ns", "u")]
    entry, lease = r.store.entry(KEY)
    assert entry is not None and lease is not None and lease.held_by_pod == "agent-0"


def test_the_events_of_one_coalescing_window_make_one_reconcile() -> None:
    kube, clock = FakeKube(), Clock(1000.0)
    r = reconciler(kube, clock, coalesce_s=0.5)
    r.on_task("ADDED", kube.put(TASKS, task()))
    event = kube.put(LEASES, held_lease())
    r.on_lease("ADDED", event, record.read(event))
    assert drain(r) == []  # the window is open
    clock.now += 0.5
    assert drain(r) == [KEY]


def test_an_unreadable_event_queues_nothing() -> None:
    r = reconciler(FakeKube(), Clock(1000.0))
    r.on_task("ADDED", {"metadata": {"namespace": "ns"}})
    event = {"metadata": {}}
    r.on_lease("ADDED", event, record.read(event))
    assert drain(r) == []


def test_a_task_whose_spec_cannot_be_read_is_skipped_and_said_once_per_version() -> None:
    """A date-time in the year 0000, which no reader can hold: the CRD refuses it now, but a
    Task stored before that rule (or under an older CRD) may have one."""
    kube = FakeKube()
    r = reconciler(kube, Clock(1000.0))
    r.on_task("ADDED", kube.put(TASKS, task(deadline="0000-01-01T00:00:00Z")))
    r.reconcile(KEY)
    r.reconcile(KEY)
    events = [e for e in kube.events() if e["reason"] == "UnreadableSpec"]
    assert len(events) == 1 and "deadline" in events[0]["message"]
    assert not [w for w in kube.writes if w[0] != "create"]  # nothing else written
    r.on_task("MODIFIED", kube.put(TASKS, task(deadline="0000-01-01T00:00:00Z", priority=1)))
    r.reconcile(KEY)
    assert len([e for e in kube.events() if e["reason"] == "UnreadableSpec"]) == 2  # a new version


def test_a_lease_duration_lowered_while_held_applies_from_the_next_attempt() -> None:
    """The holder renews by the duration it claimed with: lowering it on the Task must not
    expire a holder that renews on time."""
    kube, clock = FakeKube(), Clock(1000.0)
    r = reconciler(kube, clock)
    r.on_task("ADDED", kube.put(TASKS, task(leaseDurationSeconds=60)))
    event = kube.put(LEASES, held_lease())
    r.on_lease("ADDED", event, record.read(event))
    r.reconcile(KEY)
    r.on_task("MODIFIED", kube.put(TASKS, task(leaseDurationSeconds=5)))

    def holder() -> str:
        lease = kube.get_or_none(LEASES, "t", namespace="ns")
        assert lease is not None
        return record.decode(lease).holder
    clock.now += 12  # past the new 5 s and the grace, well within the 60 s it claimed with
    r.reconcile(KEY)
    assert holder() == "agent-0/1"
    clock.now += 50  # silent past the 60 s: expired
    r.reconcile(KEY)
    assert holder() == ""


def _reconciled_without_a_lease(kube: FakeKube, *, max_attempts: int, attempt: int) -> LeaseRecord:
    """Task t, whose status (written by hand) shows `attempt` and which has no Lease, after one
    reconcile: the Lease the operator wrote for it."""
    r = reconciler(kube, Clock(1000.0))
    body = task(maxAttempts=max_attempts)
    body["status"] = {"phase": "Pending", "reason": "Waiting", "attempt": attempt}
    r.on_task("ADDED", kube.put(TASKS, body))
    r.reconcile(KEY)
    lease = kube.get_or_none(LEASES, "t", namespace="ns")
    assert lease is not None
    return record.decode(lease)


def test_a_status_past_max_attempts_without_a_lease_is_dead_lettered_with_a_lease_at_its_epoch() -> None:
    """Written by hand through the status subresource: the operator closes the task, tells it
    (a Warning Event), and its Lease remembers the epoch, so a retry counts from there."""
    kube = FakeKube()
    rec = _reconciled_without_a_lease(kube, max_attempts=2, attempt=4)
    assert (rec.state, rec.outcome, rec.reason, rec.epoch) == (record.CLOSED, "Failed", "DeadLettered", 4)
    written = kube.get_or_none(TASKS, "t", namespace="ns")
    assert written is not None
    status = written["status"]
    assert (status["phase"], status["reason"], status["attempt"]) == ("Failed", "DeadLettered", 4)
    assert [e["message"] for e in kube.events() if e["reason"] == "DeadLettered"] == [
        "task failed after 4 attempt(s) (DeadLettered): all 2 attempts are spent: its status shows attempt 4 "
        "and it has no Lease"]


def test_a_task_claimed_before_without_a_lease_gets_a_free_one_at_its_epoch() -> None:
    """Its Lease deleted by hand: agents skip a claimed task with no Lease, so the operator
    makes a free one (owned by the Task, at the epoch its status shows) and says so."""
    kube = FakeKube()
    rec = _reconciled_without_a_lease(kube, max_attempts=3, attempt=2)
    assert (rec.state, rec.epoch, rec.owner_uid) == (record.FREE, 2, "uid-t")
    assert [e["message"] for e in kube.events() if e["reason"] == "LeaseRecreated"] == [
        "its status shows attempt 2 and it has no Lease: gave it a free Lease at attempt 2, for the agents to see"]


@pytest.mark.parametrize("remover", ["operator", "garbage collector"])
def test_a_forged_lease_gone_is_replaced_by_a_free_one(remover: str) -> None:
    """A Lease of another task by this name (here forged, at a high epoch) held the name:
    agents that lost a claim to it count the task as taken until they see its Lease free. Once
    it is gone, whoever removed it, the operator makes the task's own, free, at the task's
    epoch (not the forgery's), and says so."""
    kube = FakeKube()
    r = reconciler(kube, Clock(1000.0))
    r.on_task("ADDED", kube.put(TASKS, task()))
    forged = kube.put(LEASES, record.encode(LeaseRecord(name="t", namespace="ns", queue="q", owner_uid="forged",
                                                        holder="mallory/1", epoch=40, acquired_at=NOW,
                                                        renewed_at=NOW)))
    r.on_lease("ADDED", forged, record.decode(forged))
    if remover == "garbage collector":  # before the operator looked: its DELETED event is all it sees
        kube.delete(LEASES, "t", namespace="ns")
        r.on_lease("DELETED", forged, record.decode(forged))
    r.reconcile(KEY)
    lease = kube.get_or_none(LEASES, "t", namespace="ns")
    assert lease is not None
    rec = record.decode(lease)
    assert (rec.state, rec.epoch, rec.owner_uid) == (record.FREE, 0, "uid-t")
    assert [e["message"] for e in kube.events() if e["reason"] == "LeaseRecreated"] == [
        "a Lease of another task by its name went: gave it a free Lease at attempt 0, for the agents to see"]


def test_a_status_read_back_as_written_is_not_written_again() -> None:
    """The operator's own status write comes back through the Task watch: reconciling that
    version must find nothing to write (a write per event would feed on itself)."""
    kube = FakeKube()
    r = reconciler(kube, Clock(1000.0))
    r.on_task("ADDED", kube.put(TASKS, task()))
    lease = kube.put(LEASES, held_lease())
    r.on_lease("ADDED", lease, record.decode(lease))

    def phases_written() -> list[str]:
        return [body["status"]["phase"] for verb, _, body in kube.writes if verb == "replace/status"]
    r.reconcile(KEY)
    assert phases_written() == ["Running"]
    r.on_task("MODIFIED", kube.get_or_none(TASKS, "t", namespace="ns"))
    r.reconcile(KEY)
    assert phases_written() == ["Running"]


def test_a_deleted_holder_pod_queues_the_tasks_it_held() -> None:
    kube = FakeKube()
    r = reconciler(kube, Clock(1000.0))
    r.on_task("ADDED", kube.put(TASKS, task()))
    event = kube.put(LEASES, held_lease())
    r.on_lease("ADDED", event, record.read(event))
    drain(r)
    r.on_pod("MODIFIED", {"metadata": {"namespace": "ns", "name": "agent-0", "uid": "p1"}, "status": {}})
    assert drain(r) == []  # alive
    r.on_pod("DELETED", {"metadata": {"namespace": "ns", "name": "agent-0", "uid": "p1"}})
    assert drain(r) == [KEY]


# -- leadership seeding ----------------------------------------------------------------------


@pytest.fixture
def stop() -> Iterator[threading.Event]:
    stopped = threading.Event()
    yield stopped
    stopped.set()


def test_seeding_runs_off_the_election_thread_and_nothing_is_decided_before_it(stop: threading.Event) -> None:
    kube = ListingKube()
    r = reconciler(kube, Clock(1000.0), workers=1)
    r.queue.max_wait_s = 0.05
    r.on_task("ADDED", kube.put(TASKS, task(cancel=True)))  # a decision would write at once
    threading.Thread(target=r.run, args=(stop,), daemon=True).start()
    r.activate()  # returns while the Lease list is still under way
    assert kube.listing.wait(DEADLINE_S)
    assert kube.lister is not threading.current_thread() and kube.lister.name == "seed"
    until(r.queue.idle, "the queued key taken and put back")
    assert not r.active.is_set() and kube.writes == []  # not seeded: not decided
    assert not r.caught_up.is_set()  # readiness: a leader catching up
    kube.release.set()
    assert r.caught_up.wait(DEADLINE_S), "every task reconciled once"
    assert r.active.is_set() and kube.task_lists == 1
    assert [verb for verb, plural, _ in kube.writes if plural == "leases"] == ["create"]  # the cancel, closed


def test_losing_leadership_during_seeding_stops_it(stop: threading.Event) -> None:
    kube = ListingKube()
    r = reconciler(kube, Clock(1000.0), workers=1)
    r.queue.max_wait_s = 0.05
    r.on_task("ADDED", kube.put(TASKS, task(cancel=True)))
    threading.Thread(target=r.run, args=(stop,), daemon=True).start()
    r.activate()
    assert kube.listing.wait(DEADLINE_S)
    r.deactivate()
    kube.release.set()
    assert kube.lister is not None
    kube.lister.join(DEADLINE_S)
    assert not kube.lister.is_alive()
    assert not r.active.is_set() and kube.task_lists == 0
    until(r.queue.idle, "the queued key taken and put back")
    assert kube.writes == []


def test_a_leader_that_steps_down_decides_nothing_more(stop: threading.Event) -> None:
    kube = ListingKube()
    kube.release.set()
    r = reconciler(kube, Clock(1000.0), workers=1)
    r.queue.max_wait_s = 0.05
    threading.Thread(target=r.run, args=(stop,), daemon=True).start()
    r.activate()
    assert r.caught_up.wait(DEADLINE_S)
    r.deactivate()
    assert not r.active.is_set() and not r.caught_up.is_set()
    r.on_task("ADDED", kube.put(TASKS, task(cancel=True)))
    until(r.queue.idle, "the new key taken and put back")
    assert kube.writes == []


def test_seeding_takes_in_the_listed_leases_before_any_task_is_judged() -> None:
    kube = ListingKube()
    kube.release.set()
    r = reconciler(kube, Clock(1000.0))
    kube.put(TASKS, task())
    kube.put(LEASES, held_lease())  # held before we led; its watch event has not arrived
    r.activate()
    assert r.active.wait(DEADLINE_S)
    assert r.store.entry(KEY)[1] is not None  # before the Tasks are listed and queued
    until(lambda: r.store.entry(KEY)[0] is not None and r.queue.queued(KEY), "the listed Task taken in and queued")
    assert r.store.entry(KEY)[1] is not None and kube.task_lists == 1


# -- labels ----------------------------------------------------------------------------------


def _label_writes(kube: FakeKube) -> list[JSON]:
    return [body for verb, plural, body in kube.writes if (verb, plural) == ("patch", "tasks")]


def test_a_task_made_without_labels_is_labelled_and_projected_in_one_reconcile() -> None:
    """`kubectl apply` of a bare Task: without a shard it would reach every agent's watch.
    The status write that follows is conditional on the labelled version, not refused."""
    kube = FakeKube()
    r = reconciler(kube, Clock(1000.0))
    r.on_task("ADDED", kube.put(TASKS, task(priority=7)))
    event = kube.put(LEASES, held_lease())
    r.on_lease("ADDED", event, record.read(event))
    r.reconcile(KEY)
    assert _label_writes(kube) == [{"metadata": {"labels": {labels.LABEL_SHARD: str(labels.shard_of("t")),
                                                            labels.LABEL_RANK: labels.rank(7)}}}]
    stored = kube.get_or_none(TASKS, "t", namespace="ns")
    assert stored is not None and stored["status"]["phase"] == "Running"  # projected after the labels
    r.on_task("MODIFIED", stored)
    r.reconcile(KEY)
    assert len(_label_writes(kube)) == 1  # labelled once


def test_a_priority_edited_after_creation_gets_its_new_rank_and_keeps_its_shard() -> None:
    kube = FakeKube()
    r = reconciler(kube, Clock(1000.0))
    body = labels.labelled(task())
    body["metadata"]["labels"][labels.LABEL_SHARD] = "5"  # a valid shard, chosen by its producer
    r.on_task("ADDED", kube.put(TASKS, body))
    r.reconcile(KEY)
    assert _label_writes(kube) == []  # labelled as producers do: nothing to write
    body["spec"]["priority"] = 50
    r.on_task("MODIFIED", kube.put(TASKS, body))
    r.reconcile(KEY)
    assert _label_writes(kube) == [{"metadata": {"labels": {labels.LABEL_RANK: labels.rank(50)}}}]


def test_a_finished_task_without_labels_is_left_unlabelled() -> None:
    """No agent watches it any more: after an upgrade, only the open tasks made before are labelled."""
    kube = FakeKube()
    r = reconciler(kube, Clock(1000.0))
    body = task()
    body["status"] = {"phase": "Succeeded", "reason": "Completed", "attempt": 1}
    r.on_task("ADDED", kube.put(TASKS, body))
    r.reconcile(KEY)
    assert _label_writes(kube) == []

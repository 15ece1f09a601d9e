"""One clock (issue 30): no decision rests on a writer's clock or a writer's chosen duration.

The pure parts on injected clocks and a fake Kube (milliseconds); then against the real API
server, with agents whose clocks are set 60 s off by libfaketime (Debian's `faketime`).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import pytest
from fake_kube import FakeKube

from tasklease.api import models
from tasklease.api.timestamps import format_time
from tasklease.kube import LEASES, TASKS, JSON
from tasklease.kube.servertime import ServerClock
from tasklease.operator import cleanup, projection
from tasklease.operator.reconciler import Reconciler
from tasklease.protocol import LeaseRecord, TaskView, record
from tasklease.protocol.rules import attempts_used, claimed

pytestmark = pytest.mark.adversarial

T0 = datetime(2030, 1, 1, 12, 0, 0, tzinfo=UTC)


# -- the API server's time, from Date headers -------------------------------------------------


def _answer(server: ServerClock, *, local: datetime, skew_s: float, rtt_s: float = 0.02) -> None:
    """One request sent at `local`: the server (its clock `skew_s` ahead of ours) dates it half way."""
    stamped = local + timedelta(seconds=skew_s + rtt_s / 2)
    server.observe(format_datetime(stamped.replace(microsecond=0), usegmt=True), sent=local,
                   got=local + timedelta(seconds=rtt_s))


@pytest.mark.parametrize("skew_s", [-60.0, 60.0, 0.0])
def test_the_server_clock_is_bounded_from_date_headers_whatever_ours_says(skew_s: float) -> None:
    local = [T0]
    server = ServerClock(wall=lambda: local[0])
    assert server.earliest() == T0  # no answer yet: our own clock
    for step in range(12):  # answers at different fractions of a second narrow the bounds
        local[0] = T0 + timedelta(seconds=step * 1.37)
        _answer(server, local=local[0], skew_s=skew_s)
    truth = local[0] + timedelta(seconds=skew_s)
    assert truth - timedelta(seconds=0.3) <= server.earliest() <= truth
    assert truth <= server.latest() <= truth + timedelta(seconds=0.3)


def test_a_stepped_local_clock_starts_the_estimate_again() -> None:
    local = [T0]
    server = ServerClock(wall=lambda: local[0])
    for step in range(5):
        local[0] = T0 + timedelta(seconds=step * 1.3)
        _answer(server, local=local[0], skew_s=0)
    local[0] += timedelta(hours=1)  # our clock jumped an hour ahead; the server's did not
    _answer(server, local=local[0], skew_s=-3600)
    truth = local[0] - timedelta(hours=1)
    assert truth - timedelta(seconds=1.1) <= server.earliest() <= truth


def test_unreadable_date_headers_are_ignored() -> None:
    server = ServerClock(wall=lambda: T0)
    for header in (None, "", "yesterday", "Tue, 99 Foo 2030 99:00:00 GMT"):
        server.observe(header, sent=T0, got=T0)
    assert server.offset() == (timedelta(0), timedelta(0))


# -- the operator's decisions, on a fake Kube and pinned clocks ------------------------------


class Clocks:
    """The API server's time (what the operator's Kube estimates) and its monotonic clock."""

    def __init__(self) -> None:
        self.wall = T0
        self.mono = 1000.0

    def now(self) -> datetime:
        return self.wall

    def monotonic(self) -> float:
        return self.mono

    def advance(self, seconds: float) -> None:
        self.wall += timedelta(seconds=seconds)
        self.mono += seconds


def task_json(name: str = "t", **spec: Any) -> JSON:
    return {"apiVersion": f"{models.GROUP}/{models.VERSION}", "kind": models.KIND,
            "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "generation": 1,
                         "creationTimestamp": format_time(T0 - timedelta(minutes=5))},
            "spec": {"queue": "q", **spec}, "status": {}}


def held_lease(name: str = "t", *, epoch: int = 1, at: datetime = T0, duration_s: int = 30) -> JSON:
    holder = "agent-0/1"
    return record.encode(LeaseRecord(
        name=name, namespace="ns", queue="q", owner_uid=f"uid-{name}", holder=holder, epoch=epoch,
        duration_s=duration_s, acquired_at=at, renewed_at=at,
        history=(models.Attempt(attempt=epoch, holder=holder, claimed_at=at),)))


def failed_lease(name: str = "t", *, epoch: int = 1, not_before: datetime | None) -> JSON:
    """Attempt `epoch` failed by its holder, with the not-before that holder computed."""
    last = models.Attempt(attempt=epoch, holder="agent-0/1", claimed_at=T0, ended_at=T0, outcome="Failed",
                          message="boom")
    return record.encode(LeaseRecord(name=name, namespace="ns", queue="q", owner_uid=f"uid-{name}", epoch=epoch,
                                     renewed_at=T0, error="boom", not_before=not_before, history=(last,)))


class World:
    """A reconciler over a fake Kube: objects go in as the watches would bring them."""

    def __init__(self) -> None:
        self.clocks = Clocks()
        self.kube = FakeKube()
        self.reconciler = Reconciler(self.kube, grace_s=2.0, clock=self.clocks.now,  # type: ignore[arg-type]
                                     monotonic=self.clocks.monotonic)

    def task(self, obj: JSON) -> JSON:
        stored = self.kube.put(TASKS, obj)
        self.reconciler.on_task("ADDED", stored)
        return stored

    def lease(self, obj: JSON) -> JSON:
        current = self.kube.get_or_none(LEASES, obj["metadata"]["name"], namespace="ns")
        if current is not None:
            obj = {**obj, "metadata": {**obj["metadata"], "uid": current["metadata"]["uid"]}}
        stored = self.kube.put(LEASES, obj)
        self.reconciler.on_lease("MODIFIED" if current else "ADDED", stored)
        return stored

    def reconcile(self, name: str = "t") -> None:
        self.reconciler.reconcile(("ns", name))

    def lease_writes(self) -> list[JSON]:
        return [body for verb, plural, body in self.kube.writes if plural == "leases"]

    def record(self, name: str = "t") -> LeaseRecord:
        lease = self.kube.get_or_none(LEASES, name, namespace="ns")
        assert lease is not None
        return record.decode(lease)


def test_expiry_uses_the_tasks_duration_not_the_one_its_holder_wrote() -> None:
    world = World()
    world.task(task_json(leaseDurationSeconds=5))
    world.lease(held_lease(duration_s=86400))  # a holder that grants itself a day, then goes silent
    world.clocks.advance(6.9)  # duration 5 + grace 2, not yet
    world.reconcile()
    assert world.lease_writes() == []
    world.clocks.advance(0.1)
    world.reconcile()
    rec = world.record()
    assert rec.state == record.FREE and rec.history[-1].outcome == "Expired"


def test_a_claim_seen_before_spec_not_before_is_undone_and_not_counted() -> None:
    world = World()
    start = T0 + timedelta(seconds=60)
    world.task(task_json(notBefore=format_time(start), maxAttempts=1))
    world.lease(held_lease())  # claimed by an agent whose clock runs a minute ahead
    world.reconcile()
    rec = world.record()
    assert rec.state == record.FREE and rec.not_before == start
    assert rec.history[-1].outcome == "Undone" and rec.epoch == 1
    view = TaskView.of(world.kube.get_or_none(TASKS, "t", namespace="ns") or {})
    assert attempts_used(view, rec) == 0  # its one attempt is still there
    assert claimed(view, rec, "agent-1/1", start).epoch == 2  # and epoch 1 is never handed out again
    assert [e["reason"] for e in world.kube.events()][0] == "Undone"  # a Warning says why


def test_a_claim_seen_after_spec_not_before_stands() -> None:
    world = World()
    world.task(task_json(notBefore=format_time(T0 - timedelta(seconds=1))))
    world.lease(held_lease())
    world.reconcile()
    assert world.lease_writes() == [] and world.record().state == record.HELD


@pytest.mark.parametrize("written_s", [-55.0, 65.0, None], ids=["writer-60s-behind", "writer-60s-ahead", "none"])
def test_a_backoff_is_measured_from_when_the_operator_saw_the_attempt_fail(written_s: float | None) -> None:
    world = World()
    world.task(task_json(backoff={"policy": "Fixed", "initialSeconds": 5, "maxSeconds": 5}))
    world.lease(held_lease())
    world.clocks.advance(3)
    world.lease(failed_lease(not_before=None if written_s is None else world.clocks.wall + timedelta(
        seconds=written_s)))
    world.reconcile()
    assert world.record().not_before == world.clocks.wall + timedelta(seconds=5)


def test_a_backoff_written_on_time_is_left_alone() -> None:
    world = World()
    world.task(task_json(backoff={"policy": "Fixed", "initialSeconds": 5, "maxSeconds": 5}))
    world.lease(held_lease())
    world.clocks.advance(3)
    world.lease(failed_lease(not_before=world.clocks.wall + timedelta(seconds=5.4)))
    world.reconcile()
    assert world.lease_writes() == []


def test_a_backoff_found_too_far_ahead_is_cut_to_one_backoff_from_now() -> None:
    world = World()  # an operator that starts now: it did not see the attempt end
    world.task(task_json(backoff={"policy": "Fixed", "initialSeconds": 5, "maxSeconds": 5}))
    world.lease(failed_lease(not_before=T0 + timedelta(days=1)))
    world.reconcile()
    assert world.record().not_before == T0 + timedelta(seconds=5)


def test_the_ttl_counts_from_when_the_operator_saw_the_task_finish() -> None:
    task = task_json(ttlSecondsAfterFinished=30)
    rec = LeaseRecord(name="t", namespace="ns", queue="q", owner_uid="uid-t", epoch=1, outcome="Succeeded",
                      reason="Completed", renewed_at=T0 - timedelta(hours=1))  # the writer's clock: an hour behind
    status = projection.project(task, rec, old=models.TaskStatus(), now=T0)
    assert status.completed_at == T0
    assert cleanup.delete_at(TaskView.of(task), status, rec, default_ttl_s=None) == T0 + timedelta(seconds=30)
    later = projection.project(task, rec, old=status, now=T0 + timedelta(seconds=10))
    assert later.completed_at == T0 and projection.same(status, later)  # a re-projection keeps it

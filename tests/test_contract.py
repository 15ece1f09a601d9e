"""One contract, two implementations: `tasklease.testing`'s fake and the real API server.

Every case runs on both (`backend`), so the fake users unit-test with behaves as the real
agent and producer do: claim order, epochs, completion, retry with backoff, dead letter,
release, cancel and a lost lease. Only the fake's cases need no control plane (`make unit`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from pydantic import BaseModel

from tasklease.agent import Agent, ClaimedTask, Identity, Producer
from tasklease.api import errors, models
from tasklease.api.models import TaskSpec
from tasklease.kube import LEASES, TASKS
from tasklease.protocol import LeaseRecord, Protocol, TaskView, record
from tasklease.testing import FakeCluster

NO_BACKOFF = models.Backoff(initial_seconds=0, max_seconds=0)
LOST_WITHIN_S = 15.0  # a real holder learns an expiry at its next renewal (a third of 5 s), under load


@dataclass
class Backend:
    producer: Any  # Producer or FakeProducer: the same API
    agent: Callable[[str], Any]  # a new Agent or FakeAgent for a pod name
    lease: Callable[[str], LeaseRecord | None]
    expire: Callable[[str], None]  # what the operator does when a lease runs out


def _fake() -> Backend:
    cluster = FakeCluster()

    def lease(name: str) -> LeaseRecord | None:
        return cluster._entries[name].rec
    return Backend(producer=cluster.producer(), agent=lambda pod: cluster.agent(Identity(pod=pod, instance="1")),
                   lease=lease, expire=cluster.expire)


def _real(request: pytest.FixtureRequest) -> Backend:
    kube = request.getfixturevalue("kube")
    protocol = Protocol(kube)
    agents: list[Agent] = []

    def agent(pod: str) -> Agent:
        agents.append(Agent(kube, identity=Identity(pod=pod, instance="1")))
        return agents[-1]

    def lease(name: str) -> LeaseRecord | None:
        obj = kube.get_or_none(LEASES, name)
        return None if obj is None else record.decode(obj)

    def expire(name: str) -> None:
        rec = protocol.read(kube.namespace, name)
        assert rec is not None
        protocol.expire(TaskView.of(kube.get(TASKS, name)), rec)
    request.addfinalizer(lambda: [a.close() for a in agents])
    return Backend(producer=Producer(kube), agent=agent, lease=lease, expire=expire)


@pytest.fixture(params=[pytest.param("fake", marks=pytest.mark.unit), "real"])
def backend(request: pytest.FixtureRequest) -> Backend:
    return _fake() if request.param == "fake" else _real(request)


def _spec(**fields: Any) -> TaskSpec:
    return TaskSpec.model_validate({"queue": "c", "leaseDurationSeconds": 5, **fields})


def test_claims_go_by_priority_then_age_and_carry_the_payload(backend: Backend) -> None:
    # Ages are in seconds, ties go by name: "old" and "young" are in that order either way.
    backend.producer.submit("old", _spec(payload={"n": 1}))
    backend.producer.submit("urgent", _spec(priority=5))
    backend.producer.submit("young", _spec())
    with backend.agent("a") as agent:
        order = []
        for _ in range(3):
            task = agent.claim("c", timeout=30)
            order.append((task.name, task.epoch))
            if task.name == "old":
                assert task.payload == {"n": 1}
            task.complete("done")
    assert order == [("urgent", 1), ("old", 1), ("young", 1)]


def test_a_completed_task_keeps_its_result_and_is_never_claimed_again(backend: Backend) -> None:
    backend.producer.submit("once", _spec())
    with backend.agent("a") as agent:
        with agent.claim("c", timeout=30) as task:
            task.complete({"ok": True})
        with pytest.raises(errors.NothingToClaim):
            agent.claim("c", timeout=0.5)
    rec = backend.lease("once")
    assert rec is not None and rec.state == record.CLOSED and rec.outcome == "Succeeded"
    assert rec.result == '{"ok":true}'


def test_a_failed_attempt_is_retried_at_the_next_epoch_then_dead_lettered(backend: Backend) -> None:
    backend.producer.submit("flaky", _spec(maxAttempts=2, backoff=NO_BACKOFF.model_dump(by_alias=True)))
    with backend.agent("a") as agent:
        for epoch in (1, 2):
            with pytest.raises(RuntimeError), agent.claim("c", timeout=30) as task:
                assert task.epoch == epoch
                raise RuntimeError("boom")
        with pytest.raises(errors.NothingToClaim):
            agent.claim("c", timeout=0.5)
    rec = backend.lease("flaky")
    assert rec is not None and (rec.outcome, rec.reason) == ("Failed", "DeadLettered")
    assert "RuntimeError: boom" in rec.error


def test_a_backoff_keeps_a_failed_task_out_of_reach(backend: Backend) -> None:
    backend.producer.submit("later", _spec(backoff={"initialSeconds": 600, "maxSeconds": 600}))
    with backend.agent("a") as agent:
        agent.claim("c", timeout=30).fail("not now")
        with pytest.raises(errors.NothingToClaim):
            agent.claim("c", timeout=0.5)
    rec = backend.lease("later")
    assert rec is not None and rec.state == record.FREE and rec.not_before is not None


def test_a_final_failure_is_not_retried(backend: Backend) -> None:
    backend.producer.submit("bad", _spec(backoff=NO_BACKOFF.model_dump(by_alias=True)))
    with backend.agent("a") as agent:
        agent.claim("c", timeout=30).fail("hopeless", retryable=False)
        with pytest.raises(errors.NothingToClaim):
            agent.claim("c", timeout=0.5)
    rec = backend.lease("bad")
    assert rec is not None and (rec.outcome, rec.reason) == ("Failed", "Failed")


def test_a_released_task_is_claimable_at_once_at_the_next_epoch(backend: Backend) -> None:
    backend.producer.submit("back", _spec(backoff={"initialSeconds": 600, "maxSeconds": 600}))
    with backend.agent("a") as agent:
        with agent.claim("c", timeout=30):
            pass  # left without an outcome: released
        task = agent.claim("c", timeout=30)
        assert (task.name, task.epoch) == ("back", 2)
        task.complete()


def test_a_cancel_reaches_the_holder_as_a_lost_lease(backend: Backend) -> None:
    backend.producer.submit("stop-me", _spec())
    with backend.agent("a") as agent:
        task = agent.claim("c", timeout=30)
        told = threading.Event()
        task.on_lost.append(lambda _: told.set())
        backend.producer.cancel("stop-me")
        assert task.lost.wait(LOST_WITHIN_S) and told.wait(LOST_WITHIN_S)
        assert "cancelled" in task.lost_reason
        with pytest.raises(errors.LostLease):
            task.check()


def test_an_expired_holder_loses_its_lease_and_its_late_writes_are_refused(backend: Backend) -> None:
    backend.producer.submit("slow", _spec(backoff=NO_BACKOFF.model_dump(by_alias=True)))
    with backend.agent("a") as first, backend.agent("b") as second:
        task = first.claim("c", timeout=30)
        backend.expire("slow")
        assert task.lost.wait(LOST_WITHIN_S)
        with pytest.raises(errors.LostLease):
            task.complete("too late")
        again = second.claim("c", timeout=30)
        assert (again.name, again.epoch) == ("slow", 2)
        again.complete("mine")
    rec = backend.lease("slow")
    assert rec is not None and rec.result == "mine"


class Order(BaseModel):
    id: int
    items: list[str]


def test_work_hands_a_typed_payload_and_fails_for_good_one_that_does_not_fit(backend: Backend) -> None:
    backend.producer.submit("fits", _spec(payload={"id": 7, "items": ["a"]}))
    backend.producer.submit("misfit", _spec(payload={"id": "seven"}))
    seen: list[Order] = []

    def handle(task: ClaimedTask, order: Order) -> Order:
        seen.append(order)
        return order
    with backend.agent("a") as agent:
        assert agent.work("c", handle, payload_type=Order, idle_timeout=1, drain=False) == 1
    assert seen == [Order(id=7, items=["a"])]
    fits, misfit = backend.lease("fits"), backend.lease("misfit")
    assert fits is not None and fits.result == '{"id":7,"items":["a"]}'
    assert misfit is not None and (misfit.outcome, misfit.reason) == ("Failed", "Failed")
    assert "does not fit Order: id:" in misfit.error


def test_what_cannot_be_claimed_or_written_is_refused_at_once_and_loses_no_task(backend: Backend) -> None:
    """A queue no task can be in, a name that is none, a result that is no JSON, an interrupt
    off the main thread: Invalid at once, nothing claimed, the task still held where it was."""
    with pytest.raises(errors.Invalid):
        backend.producer.submit("", _spec())
    backend.producer.submit("kept", _spec())
    with backend.agent("a") as agent:
        for queue in ("", "Bad_Queue", 123):
            with pytest.raises(errors.Invalid):
                agent.claim(queue, timeout=30)
        refused: list[BaseException] = []

        def off_main() -> None:
            try:
                agent.claim("c", timeout=30, interrupt=True)
            except errors.TaskleaseError as exc:
                refused.append(exc)
        thread = threading.Thread(target=off_main)
        thread.start()
        thread.join(30)
        assert refused and isinstance(refused[0], errors.Invalid)
        rec = backend.lease("kept")
        assert rec is None or rec.state == record.FREE  # not claimed by the refused call
        task = agent.claim("c", timeout=30)
        for result in ({1, 2}, float("nan")):
            with pytest.raises(errors.Invalid):
                task.complete(result)
        assert not task.finished
        task.complete({"n": 1})


def test_closing_an_agent_tells_the_work_it_still_runs(backend: Backend) -> None:
    """The task is given back for another agent: its work is told, as of a lost lease, and
    its outcome would be refused."""
    backend.producer.submit("running", _spec())
    agent = backend.agent("a")
    task = agent.claim("c", timeout=30)
    agent.close()
    assert task.lost.is_set() and "closed" in task.lost_reason
    with pytest.raises(errors.LostLease):
        task.check()
    rec = backend.lease("running")
    assert rec is not None and rec.state == record.FREE

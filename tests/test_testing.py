"""tasklease.testing's fake on its own: what only an injected clock shows, and how fast it is."""

from __future__ import annotations

import threading
import time

import pytest

from tasklease.api import errors, models
from tasklease.api.models import TaskSpec
from tasklease.testing import FakeCluster

pytestmark = pytest.mark.unit


def test_a_backoff_ends_when_the_clock_is_advanced_past_it() -> None:
    cluster = FakeCluster()
    cluster.producer().submit("t", TaskSpec.model_validate(
        {"queue": "q", "backoff": {"initialSeconds": 60, "maxSeconds": 60, "jitter": False}}))
    with cluster.agent() as agent:
        agent.claim("q", timeout=0).fail("later")
        assert cluster.producer().get("t").status.reason == "BackingOff"
        with pytest.raises(errors.NothingToClaim):
            agent.claim("q", timeout=0)
        cluster.clock.advance(59)
        with pytest.raises(errors.NothingToClaim):
            agent.claim("q", timeout=0)
        cluster.clock.advance(1)
        assert agent.claim("q", timeout=0).epoch == 2


def test_older_tasks_go_first_within_a_band() -> None:
    cluster = FakeCluster()
    cluster.producer().submit("b-old", TaskSpec(queue="q"))
    cluster.clock.advance(1)
    cluster.producer().submit("a-new", TaskSpec(queue="q"))
    with cluster.agent() as agent:
        assert [agent.claim("q", timeout=0).name for _ in range(2)] == ["b-old", "a-new"]


def test_a_handler_is_unit_tested_in_milliseconds_with_producer_status_and_retry() -> None:
    cluster = FakeCluster()
    producer = cluster.producer()
    producer.submit("e1", TaskSpec.model_validate({"queue": "emails", "maxAttempts": 1, "payload": {"to": "x"}}))
    started = time.monotonic()
    with cluster.agent() as agent:
        assert agent.work("emails", lambda task: 1 / 0, idle_timeout=0) == 0
        dead = producer.wait("e1", timeout=1)
        assert (dead.status.phase, dead.status.reason) == (models.Phase.FAILED, "DeadLettered")
        assert "ZeroDivisionError" in dead.status.last_error
        producer.retry("e1")
        assert agent.work("emails", lambda task: {"sent": task.payload["to"]}, idle_timeout=0) == 1
    done = producer.get("e1")
    assert (done.status.phase, done.status.result, done.status.attempt) == (models.Phase.SUCCEEDED, '{"sent":"x"}', 2)
    assert time.monotonic() - started < 1


def test_work_runs_tasks_side_by_side_with_concurrency() -> None:
    cluster = FakeCluster()
    cluster.producer().submit_many([(f"t{i}", TaskSpec(queue="q")) for i in range(4)])
    barrier = threading.Barrier(4, timeout=5)

    def handler(task: object) -> str:
        barrier.wait()  # only four tasks at once get past this
        return "ok"
    with cluster.agent() as agent:
        assert agent.work("q", handler, concurrency=4, idle_timeout=0) == 4


def test_close_wakes_a_waiting_claim() -> None:
    cluster = FakeCluster()
    agent = cluster.agent()
    woke: list[BaseException] = []

    def wait() -> None:
        try:
            agent.claim("q")
        except errors.NothingToClaim as exc:
            woke.append(exc)
    thread = threading.Thread(target=wait)
    thread.start()
    agent.close()
    thread.join(5)
    assert woke and "closed" in str(woke[0])

"""The producer SDK and the asyncio agent loop against a real API server."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from conftest import Cluster, Operator, wait_for
from tasklease.agent import Agent, AsyncAgent, LostLease, Producer, Task
from tasklease.api import errors, models
from tasklease.kube import Kube


def test_submit_is_idempotent_by_name_and_wait_follows_the_task_to_its_end(
        kube: Kube, namespace: str, operator: Operator) -> None:
    producer = Producer(kube)
    spec = models.TaskSpec(queue="prod", payload={"n": 1})
    first = producer.submit("job-1", spec)
    assert isinstance(first, Task) and first.spec.payload == {"n": 1}
    assert producer.submit("job-1", spec).uid == first.uid  # a repeated submission is the same task
    with pytest.raises(errors.Conflict):
        producer.submit("job-1", models.TaskSpec(queue="prod", payload={"n": 2}))
    many = producer.submit_many([(f"job-{i}", models.TaskSpec(queue="prod", priority=i)) for i in (2, 3)])
    assert [t.name for t in many] == ["job-2", "job-3"]
    assert sorted(t.name for t in producer.list(queue="prod")) == ["job-1", "job-2", "job-3"]
    began = time.monotonic()
    with pytest.raises(TimeoutError):
        producer.wait("job-1", timeout=1.2)
    assert time.monotonic() - began < 1.9  # not the whole seconds a watch's own timeout counts

    agent = Agent(kube)
    worker = threading.Thread(target=agent.work, args=("prod", lambda t: f"done {t.name}"),
                              kwargs={"max_tasks": 3, "idle_timeout": 60})
    worker.start()
    try:
        done = producer.wait("job-1", timeout=60)
        assert (done.status.phase, done.status.result) == (models.Phase.SUCCEEDED, "done job-1")
    finally:
        worker.join(90)
        agent.close()
    wait_for(lambda: len(producer.list(phase=models.Phase.SUCCEEDED)) == 3, message="all three projected")
    with pytest.raises(errors.Invalid, match="never re-run"):
        producer.retry("job-1")
    assert producer.cancel("job-2").spec.cancel is True  # finished: stays Succeeded, the request is recorded


def test_a_failed_task_is_retried_through_the_sdk(kube: Kube, namespace: str, operator: Operator) -> None:
    producer = Producer(kube)
    producer.submit("once", models.TaskSpec(queue="sdk-retry", max_attempts=1))
    agent = Agent(kube)
    try:
        with pytest.raises(RuntimeError), agent.claim("sdk-retry", timeout=30):
            raise RuntimeError("boom")
        failed = producer.wait("once", timeout=60)
        assert (failed.status.phase, failed.status.reason) == (models.Phase.FAILED, "DeadLettered")
        producer.retry("once")
        wait_for(lambda: producer.get("once").status.phase is models.Phase.PENDING, message="Pending again")
        with agent.claim("sdk-retry", timeout=30) as task:
            assert task.epoch == 2
            task.complete("ok")
        assert producer.wait("once", timeout=60).status.phase is models.Phase.SUCCEEDED
    finally:
        agent.close()


def test_the_asyncio_loop_claims_completes_and_hears_of_a_cancel(cluster: Cluster, kube: Kube, namespace: str,
                                                                  tmp_path: Path) -> None:
    producer = Producer(kube)
    producer.submit("a-ok", models.TaskSpec(queue="aio"))
    producer.submit("a-cancel", models.TaskSpec(queue="aio-cancel", lease_duration_seconds=300))

    async def main() -> tuple[str, str]:
        agent = AsyncAgent(Agent(kube))
        try:
            async with agent.claim("aio", timeout=30) as task:
                await task.complete({"epoch": task.epoch})
            finished = task.name
            with pytest.raises(LostLease, match="cancelled"):
                async with agent.claim("aio-cancel", timeout=30) as held:
                    await asyncio.to_thread(producer.cancel, held.name)
                    await asyncio.sleep(120)  # ended by the cancel long before this
            return finished, held.name
        finally:
            await agent.close()

    assert asyncio.run(main()) == ("a-ok", "a-cancel")
    from tasklease.kube import LEASES
    from tasklease.protocol import record

    assert record.decode(kube.get(LEASES, "a-ok")).result == '{"epoch":1}'

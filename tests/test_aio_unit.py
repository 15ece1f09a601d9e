"""The asyncio agent and producer on tasklease.testing's fake (no control plane)."""

from __future__ import annotations

import asyncio

import pytest

from tasklease.agent import AsyncAgent, AsyncClaimedTask, AsyncProducer
from tasklease.api import errors, models
from tasklease.api.models import TaskSpec
from tasklease.testing import FakeCluster

pytestmark = pytest.mark.unit


def test_an_async_work_loop_runs_tasks_side_by_side_and_a_cancel_stops_its_handler() -> None:
    cluster = FakeCluster()
    producer = AsyncProducer(cluster.producer())  # type: ignore[arg-type]
    running: set[str] = set()
    both = asyncio.Event()

    async def handler(task: AsyncClaimedTask) -> str:
        running.add(task.name)
        if len(running) == 2:
            both.set()
        await both.wait()  # one at a time, this would never return
        if task.name == "doomed":
            await producer.cancel("doomed")
            await asyncio.sleep(30)  # cancelled by the lost lease long before
        return "ok"

    async def main() -> int:
        await producer.submit_many([("doomed", TaskSpec(queue="q")), ("fine", TaskSpec(queue="q"))])
        async with AsyncAgent(cluster.agent()) as agent:  # type: ignore[arg-type]
            return await asyncio.wait_for(agent.work("q", handler, concurrency=2, idle_timeout=0.2), 20)
    assert asyncio.run(main()) == 1
    states = {t.name: t.status.phase for t in cluster.producer().list()}
    assert states == {"doomed": models.Phase.CANCELLED, "fine": models.Phase.SUCCEEDED}


def test_a_cancelled_wait_for_a_claim_leaves_no_task_behind() -> None:
    cluster = FakeCluster()

    async def main() -> None:
        agent = AsyncAgent(cluster.agent())  # type: ignore[arg-type]
        claim = agent.claim("q")

        async def wait() -> None:
            async with claim:
                pass
        waiting = asyncio.create_task(wait())
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        cluster.producer().submit("late", TaskSpec(queue="q"))
        await asyncio.sleep(0.7)  # the stopped claim notices its stop within half a second
        await agent.close()
    asyncio.run(main())
    with cluster.agent() as other:
        assert other.claim("q", timeout=1).name == "late"  # nobody took it meanwhile


def test_a_lease_lost_after_the_blocks_last_await_cancels_nothing_after_the_block() -> None:
    """The loss lands as the block ends without another await: the block ends in LostLease,
    and the caller's next await is not cancelled (no exception outside the block)."""
    cluster = FakeCluster()

    async def main() -> str:
        cluster.producer().submit("doomed", TaskSpec(queue="q"))
        async with AsyncAgent(cluster.agent()) as agent:  # type: ignore[arg-type]
            try:
                async with agent.claim("q", timeout=5) as task:
                    cluster.producer().cancel("doomed")
                    assert task.lost.wait(5)  # lost, and no await left in the block
            except errors.LostLease:
                pass
            await asyncio.sleep(0.05)  # cancelled here before the fix
            return "after the block"
    assert asyncio.run(main()) == "after the block"

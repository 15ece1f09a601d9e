"""The agent loop for asyncio programs: `async with agent.claim(queue) as task:`.

    agent = AsyncAgent(Agent.connect())
    async with agent.claim("emails") as task:
        await send(task.payload, fence=task.epoch)
        await task.complete("sent")

The blocking parts (the watch-driven wait for a task, the conditional writes) run in
worker threads (`asyncio.to_thread`); the event loop never blocks. Renewal stays in the
SDK's renew thread. When the lease is lost (expired, cancelled, deleted, taken over) the
asyncio task running the `async with` block is cancelled and the block ends in `LostLease`
instead of CancelledError: the same contract as the thread SDK, with cancellation in place
of the thread interrupt.
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Any

from tasklease.agent.sdk import Agent, ClaimedTask
from tasklease.api import errors


class AsyncClaimedTask:
    """One held attempt, for `async with`. Leaving without an outcome releases the task, an
    exception fails the attempt (retryable), a lost lease raises LostLease."""

    def __init__(self, agent: Agent, queue: str, timeout: float | None) -> None:
        self._agent, self._queue, self._timeout = agent, queue, timeout
        self._task: ClaimedTask | None = None
        self._cancelled_by_us = False

    @property
    def claimed(self) -> ClaimedTask:
        if self._task is None:
            raise errors.Invalid("not claimed yet: use `async with agent.claim(queue) as task`")
        return self._task

    @property
    def name(self) -> str:
        return self.claimed.name

    @property
    def epoch(self) -> int:
        return self.claimed.epoch

    @property
    def payload(self) -> dict[str, Any]:
        return self.claimed.payload

    async def complete(self, result: Any = "") -> None:
        await asyncio.to_thread(self.claimed.complete, result)

    async def fail(self, message: str, *, retryable: bool = True) -> None:
        await asyncio.to_thread(self.claimed.fail, message, retryable=retryable)

    async def release(self, message: str = "released by its holder") -> None:
        await asyncio.to_thread(self.claimed.release, message)

    async def __aenter__(self) -> AsyncClaimedTask:
        self._task = await asyncio.to_thread(self._agent.claim, self._queue, timeout=self._timeout, interrupt=False)
        loop, current = asyncio.get_running_loop(), asyncio.current_task()

        def lost(_: ClaimedTask) -> None:
            if current is not None:
                self._cancelled_by_us = True
                loop.call_soon_threadsafe(current.cancel)
        self._task.on_lost.append(lost)
        if self._task.lost.is_set():  # lost before the callback was in place
            lost(self._task)
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        task = self.claimed
        if self._cancelled_by_us and isinstance(exc, asyncio.CancelledError):
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()
            raise errors.LostLease(task.lost_reason) from None
        if task.finished or task.lost.is_set():
            if task.lost.is_set() and exc is None:
                raise errors.LostLease(task.lost_reason)
            return
        if exc is None:
            await self.release("left the work without an outcome")
        elif not isinstance(exc, (errors.LostLease, asyncio.CancelledError)):
            await self.fail(f"{kind.__name__ if kind else 'error'}: {exc}")
        else:
            await self.release(f"stopped: {kind.__name__ if kind else 'cancelled'}")


class AsyncAgent:
    """An `Agent` for asyncio code; `close()` it (or the Agent) when done."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    async def start(self) -> list[str]:
        return await asyncio.to_thread(self.agent.start)

    def claim(self, queue: str, *, timeout: float | None = None) -> AsyncClaimedTask:
        """`async with agent.claim(queue) as task:` waits (watch-driven) until a task is ours."""
        return AsyncClaimedTask(self.agent, queue, timeout)

    async def close(self) -> None:
        await asyncio.to_thread(self.agent.close)

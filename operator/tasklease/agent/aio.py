"""The agent and producer for asyncio programs: `async with agent.claim(queue) as task:`.

    async with AsyncAgent(Agent.connect()) as agent:
        async with agent.claim("emails") as task:
            await send(task.payload, fence=task.epoch)
            await task.complete("sent")
        await agent.work("emails", send_one, concurrency=8)   # async def send_one(task): ...

    producer = AsyncProducer(Producer.connect())
    await producer.submit("e1", TaskSpec(queue="emails"))

The blocking parts (the watch-driven wait for a task, the conditional writes) run in
worker threads (`asyncio.to_thread`); the event loop never blocks. Renewal stays in the
SDK's renew thread. When the lease is lost (expired, cancelled, deleted, taken over) the
asyncio task running the `async with` block is cancelled and the block ends in `LostLease`
instead of CancelledError: the same contract as the thread SDK, with cancellation in place
of the thread interrupt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping
from types import TracebackType
from typing import Any

from pydantic import BaseModel

from tasklease.agent.producer import Producer, Task
from tasklease.agent.sdk import Agent, ClaimedTask
from tasklease.api import errors, models

log = logging.getLogger(__name__)


class AsyncClaimedTask:
    """One held attempt, for `async with`. Leaving without an outcome releases the task, an
    exception fails the attempt (retryable), a lost lease raises LostLease."""

    def __init__(self, agent: Agent, queue: str, timeout: float | None) -> None:
        self._agent, self._queue, self._timeout = agent, queue, timeout
        self._task: ClaimedTask | None = None
        self._cancelled_by_us = False
        self._inside = False  # in the `async with` block: only there may a lost lease cancel

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

    @property
    def lost(self) -> threading.Event:
        return self.claimed.lost

    def check(self) -> None:
        self.claimed.check()

    async def complete(self, result: Any = "") -> None:
        await asyncio.to_thread(self.claimed.complete, result)

    async def fail(self, message: str, *, retryable: bool = True) -> None:
        await asyncio.to_thread(self.claimed.fail, message, retryable=retryable)

    async def release(self, message: str = "released by its holder") -> None:
        await asyncio.to_thread(self.claimed.release, message)

    async def __aenter__(self) -> AsyncClaimedTask:
        stop = threading.Event()
        claiming = asyncio.ensure_future(asyncio.to_thread(self._agent.claim, self._queue, timeout=self._timeout,
                                                           stop=stop))
        try:
            self._task = await asyncio.shield(claiming)
        except asyncio.CancelledError:
            # The waiting thread cannot be cancelled: stop it, and give back what it may still win.
            stop.set()
            claiming.add_done_callback(_give_back)
            raise
        loop, current = asyncio.get_running_loop(), asyncio.current_task()
        self._inside = True

        def cancel_inside() -> None:
            """On the loop, as `__aexit__` runs: a loss after the block has ended cancels nothing."""
            if self._inside and current is not None and not current.done():
                self._cancelled_by_us = True
                current.cancel()

        def lost(_: ClaimedTask) -> None:
            loop.call_soon_threadsafe(cancel_inside)
        self._task.on_lost.append(lost)
        if self._task.lost.is_set():  # lost before the callback was in place
            lost(self._task)
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        task = self.claimed
        self._inside = False
        if self._cancelled_by_us:
            current = asyncio.current_task()
            if not isinstance(exc, asyncio.CancelledError):
                # Cancelled after the block's last await: the cancellation is taken here, not
                # by the caller's next await after the block.
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(0)
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


def _give_back(claiming: asyncio.Future[ClaimedTask]) -> None:
    if claiming.cancelled() or claiming.exception() is not None:
        return
    task = claiming.result()
    with contextlib.suppress(errors.TaskleaseError):
        task.release("the claiming coroutine was cancelled")


class AsyncAgent:
    """An `Agent` for asyncio code; `close()` it (or leave its `async with`) when done."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    async def __aenter__(self) -> AsyncAgent:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def work(self, queue: str, handler: Callable[..., Awaitable[Any]], *, concurrency: int = 1,
                   max_tasks: int | None = None, idle_timeout: float | None = None,
                   payload_type: type[BaseModel] | None = None) -> int:
        """The worker loop, `concurrency` tasks at a time: `await handler(task)` (`handler(task,
        payload)` with a `payload_type`) and complete with what it returns. A lost lease cancels
        the handler. Returns how many completed; ends after `max_tasks` completed, after
        `idle_timeout` idle, or when cancelled (the tasks running are released)."""
        if concurrency < 1:
            raise errors.Invalid(f"concurrency must be at least 1, not {concurrency}")
        done = 0
        in_flight = 0

        async def loop() -> None:
            nonlocal done, in_flight
            while max_tasks is None or done + in_flight < max_tasks:
                in_flight += 1
                try:
                    completed = await self._one(queue, handler, idle_timeout, payload_type)
                    done += completed  # not `done += await`: that reads `done` before the wait
                except errors.NothingToClaim:
                    return
                finally:
                    in_flight -= 1
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        return done

    async def _one(self, queue: str, handler: Callable[..., Awaitable[Any]], idle_timeout: float | None,
                   payload_type: type[BaseModel] | None) -> int:
        try:
            async with self.claim(queue, timeout=idle_timeout) as task:
                args: tuple[Any, ...] = (task,)
                if payload_type is not None:
                    try:
                        args = (task, task.claimed.payload_as(payload_type))
                    except errors.Invalid as exc:
                        await task.fail(str(exc), retryable=False)
                        log.error("%s", exc)
                        return 0
                result = await handler(*args)
                if not task.claimed.finished:
                    await task.complete(result if result is not None else "")
                    return 1
        except errors.LostLease as exc:
            log.warning("gave up %s: %s", queue, exc)
        except (errors.Unreachable, errors.ServerError) as exc:
            log.warning("claiming from %s failed (%s); retrying", queue, exc)
            await asyncio.sleep(self.agent.settings.retry_s)
        except errors.NothingToClaim:
            raise
        except Exception:  # noqa: BLE001 - the attempt was failed on leaving the block; keep working
            log.exception("a task of %s failed", queue)
        return 0

    async def start(self) -> list[str]:
        return await asyncio.to_thread(self.agent.start)

    def claim(self, queue: str, *, timeout: float | None = None) -> AsyncClaimedTask:
        """`async with agent.claim(queue) as task:` waits (watch-driven) until a task is ours."""
        return AsyncClaimedTask(self.agent, queue, timeout)

    async def close(self) -> None:
        await asyncio.to_thread(self.agent.close)


class AsyncProducer:
    """A `Producer` for asyncio code: the same methods, awaited (each runs in a worker thread)."""

    def __init__(self, producer: Producer) -> None:
        self.producer = producer

    async def submit(self, name: str | None, spec: models.TaskSpec, *,
                     labels: Mapping[str, str] | None = None) -> Task:
        return await asyncio.to_thread(self.producer.submit, name, spec, labels=labels)

    async def submit_many(self, tasks: Iterable[tuple[str, models.TaskSpec]]) -> list[Task]:
        return await asyncio.to_thread(self.producer.submit_many, list(tasks))

    async def get(self, name: str) -> Task:
        return await asyncio.to_thread(self.producer.get, name)

    async def list(self, *, queue: str | None = None, phase: models.Phase | None = None,
                   selector: str = "") -> list[Task]:
        return await asyncio.to_thread(self.producer.list, queue=queue, phase=phase, selector=selector)

    async def wait(self, name: str, *, timeout: float | None = None) -> Task:
        return await asyncio.to_thread(self.producer.wait, name, timeout=timeout)

    async def cancel(self, name: str) -> Task:
        return await asyncio.to_thread(self.producer.cancel, name)

    async def retry(self, name: str) -> Task:
        return await asyncio.to_thread(self.producer.retry, name)

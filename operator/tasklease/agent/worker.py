"""The worker loop behind `agent.work(queue, handler)`: claim, run the handler, end the attempt.

    agent.work("emails", send, concurrency=4)                  # four tasks at a time
    agent.work("emails", send, payload_type=Email)             # send(task, email): a pydantic model

`concurrency` threads claim and run tasks side by side. A lost lease sets `task.lost`: a
long handler watches it or calls `task.check()`. On the main thread, `work` is the program's
entry point and drains on SIGTERM (`drain=True`): it claims no more, lets the handlers running
finish within `grace_s`, gives back (releases) what is still running then, and returns. That
handler is the only signal handler the SDK installs, only for as long as `work` runs, and the
one before it is put back. The same loop serves `tasklease.testing`'s fake agent.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from pydantic import BaseModel

from tasklease.agent.claimed import ClaimedTask
from tasklease.api import errors

log = logging.getLogger(__name__)

Claim = Callable[[str, float | None, threading.Event], ClaimedTask]  # (queue, timeout, stop)
Handler = Callable[..., Any]  # handler(task), or handler(task, payload) with a payload_type


class Worker:
    """One run of the loop (`agent.work`)."""

    def __init__(self, claim: Claim, queue: str, handler: Handler, *, concurrency: int = 1,
                 stop: threading.Event | None = None, max_tasks: int | None = None,
                 idle_timeout: float | None = None, payload_type: type[BaseModel] | None = None,
                 drain: bool = True, grace_s: float = 30.0, retry_s: float = 1.0) -> None:
        if concurrency < 1:
            raise errors.Invalid(f"concurrency must be at least 1, not {concurrency}")
        self._claim, self.queue, self._handler = claim, queue, handler
        self.concurrency = concurrency
        self.stop = stop or threading.Event()
        self._max_tasks, self._idle_timeout = max_tasks, idle_timeout
        self._payload_type = payload_type
        self._drain, self.grace_s, self._retry_s = drain, grace_s, retry_s
        self._lock = threading.Condition()
        self._done = 0
        self._in_flight = 0  # being claimed or run
        self._running: set[ClaimedTask] = set()

    def run(self) -> int:
        """How many tasks were completed."""
        with self._drain_on_sigterm():
            threads = [threading.Thread(target=self._loop, name=f"work-{self.queue}-{i}", daemon=True)
                       for i in range(self.concurrency - 1)]
            for thread in threads:
                thread.start()
            self._loop()
            for thread in threads:
                thread.join()
        return self._done

    def drain(self) -> None:
        """Claim no more; give back what still runs `grace_s` from now."""
        if self.stop.is_set():
            return
        self.stop.set()
        log.info("draining the work on %s: no more claims; %.0fs for the tasks running", self.queue, self.grace_s)
        timer = threading.Timer(self.grace_s, self._give_back)
        timer.daemon = True
        timer.start()

    def _give_back(self) -> None:
        with self._lock:
            running = list(self._running)
        for task in running:
            task.give_back(f"its worker drained and the {self.grace_s:g}s grace ran out")

    def _loop(self) -> None:
        while not self.stop.is_set():
            with self._lock:
                if not self._room():
                    continue
                self._in_flight += 1
            task = None
            try:
                task = self._claim(self.queue, self._idle_timeout, self.stop)
            except errors.NothingToClaim:
                self.stop.set()  # idle, stopped or closed: every thread of the loop ends
            except (errors.Unreachable, errors.ServerError) as exc:
                log.warning("claiming from %s failed (%s); retrying", self.queue, exc)
                self.stop.wait(self._retry_s)
            if task is None:
                with self._lock:
                    self._in_flight -= 1
                    self._lock.notify_all()
                continue
            with self._lock:
                self._running.add(task)
            completed = self._run_one(task)
            with self._lock:
                self._running.discard(task)
                self._in_flight -= 1
                self._done += completed
                self._lock.notify_all()

    def _room(self) -> bool:
        """Caller holds the lock. Whether one more claim may start now (max_tasks counts the
        completed ones: those running may yet fail). Ends the loop once enough completed."""
        if self._max_tasks is None or self._done + self._in_flight < self._max_tasks:
            return True
        if self._done >= self._max_tasks:
            self.stop.set()
        else:
            self._lock.wait(self._retry_s)
        return False

    def _run_one(self, task: ClaimedTask) -> bool:
        """True when it completed."""
        try:
            with task:
                args: tuple[Any, ...] = (task,)
                if self._payload_type is not None:
                    try:
                        args = (task, task.payload_as(self._payload_type))
                    except errors.Invalid as exc:
                        task.fail(str(exc), retryable=False)  # no retry makes it fit
                        log.error("%s", exc)
                        return False
                result = self._handler(*args)
                if not task.lost.is_set() and not task.finished:
                    task.complete(result if result is not None else "")
                    return True
        except errors.LostLease as exc:
            log.warning("gave up %s/%s: %s", task.namespace, task.name, exc)
        except Exception:  # noqa: BLE001 - the attempt was failed in __exit__; keep working
            log.exception("task %s/%s failed", task.namespace, task.name)
        return False

    @contextmanager
    def _drain_on_sigterm(self) -> Iterator[None]:
        if not self._drain or threading.current_thread() is not threading.main_thread():
            yield
            return

        def on_sigterm(signum: int, frame: FrameType | None) -> None:
            self.drain()
        previous = signal.signal(signal.SIGTERM, on_sigterm)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)

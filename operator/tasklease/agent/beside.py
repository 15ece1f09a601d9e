"""Requests an agent makes beside its own: a queue's controls, a second LIST, its joining of a queue.

The controls and the second LIST are read while the first LIST is; an agent joins a queue
while its first look reads.

They run on at most two threads, kept for the agent's life: a thread started and joined per
claim would add its start and its join to every one-shot claim. Nothing run here waits for
anything else run here (a join waits for its own member Lease in a watch, at most
`AgentSettings.join_s`), so two threads cannot deadlock however many callers share them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class Beside(Executor):
    """A thread pool started at its first call and ended by `shutdown` (the agent's close);
    a call after that runs in the caller's thread."""

    def __init__(self, workers: int = 2) -> None:
        self._workers = workers
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        with self._lock:
            if not self._closed:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="tasklease-beside")
                return self._pool.submit(fn, *args, **kwargs)
        done: Future[T] = Future()
        try:
            done.set_result(fn(*args, **kwargs))
        except Exception as exc:  # as a pool's Future holds it: raised by `result()`
            done.set_exception(exc)
        return done

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=wait, cancel_futures=cancel_futures)

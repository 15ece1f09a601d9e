"""One held attempt (`ClaimedTask`): renewed in the background, ended with one write, and lost
the moment its lease is.

A loss reaches the work cooperatively: `task.lost` (a `threading.Event`) is set, `task.check()`
raises `LostLease` from then on, and the `on_lost` callbacks run on a thread of their own.
Only a claim made with `interrupt=True` also gets `LostLease` raised into the work, and only on
the main thread (see `_MainThreadInterrupt` for its limits). The library installs no signal
handler otherwise and injects no exception into any other thread.
"""

from __future__ import annotations

import _thread
import heapq
import itertools
import json
import logging
import signal
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any, Protocol, TypeVar

import pydantic

from tasklease.agent.cancel import Followers, Following
from tasklease.agent.settings import AgentSettings
from tasklease.api import errors
from tasklease.protocol import Held

log = logging.getLogger(__name__)

OnLost = Callable[["ClaimedTask"], None]
M = TypeVar("M", bound=pydantic.BaseModel)


class LeaseWriter(Protocol):
    """The writes a claim makes: `tasklease.protocol.Protocol` against the API server, or
    `tasklease.testing`'s in-memory one."""

    def renew(self, held: Held, *, timeout: float = 30) -> Held: ...
    def complete(self, held: Held, result: str) -> Held: ...
    def fail(self, held: Held, message: str, *, retryable: bool = True) -> Held: ...
    def release(self, held: Held, message: str = "released by its holder") -> Held: ...


class Observer(Protocol):
    """Told when an attempt starts and how it ends (`agent.metrics.AgentMetrics`). `outcome`:
    completed, failed, released or lost; `seconds`: from the claim to that end."""

    def claimed(self, task: ClaimedTask) -> None: ...
    def ended(self, task: ClaimedTask, outcome: str, seconds: float) -> None: ...


class ClaimedTask:
    """One held attempt. Use it as a context manager: an exception fails the attempt
    (retryable), leaving without an outcome releases it.

    Renewal stops when the attempt ends, and also when this object is dropped without
    ending (the renew thread holds only a weak reference): the lease then expires.
    Locks are never held across a request: `_state` guards the fields, `_writing` lets
    one write (a renewal or the ending) at a time use the Lease's last resourceVersion."""

    def __init__(self, protocol: LeaseWriter, held: Held, payload: dict[str, Any], *, interrupt: bool = False,
                 followers: Followers | None = None, renewals: Renewals | None = None,
                 settings: AgentSettings | None = None, monotonic: Callable[[], float] = time.monotonic,
                 observer: Observer | None = None) -> None:
        """`followers`: hear of a cancel or deletion of the Task at once (None: at the next renewal,
        for a claim handed over to another process). `renewals`: the agent's scheduler of first
        renewals (None: one for this claim alone)."""
        self.protocol = protocol
        self._held = held
        self.payload = payload
        self.lost = threading.Event()
        self.lost_reason = ""
        self.on_lost: list[OnLost] = []
        self._settings = settings or AgentSettings()
        self._interrupt = _MainThreadInterrupt(self) if interrupt else None
        self._inside = False  # within the `with` block: the only time an interrupt is delivered
        self._monotonic = monotonic
        self._state = threading.Lock()
        self._writing = threading.Lock()
        self._done = False
        self._stop = threading.Event()
        self._following: Following | None = None
        self._last_ok = monotonic()
        self._observer = observer
        self._started = monotonic()
        self._observed = False  # its end was told to the observer
        if observer is not None:
            observer.claimed(self)
        if followers is not None:
            # Instant cancel. Held weakly, like the renew thread's reference: a dropped claim is let go.
            # Every field is set by now: a cancel the watch saw already is delivered in this call.
            cancelled = weakref.WeakMethod(self._cancelled)

            def on_cancel(why: str) -> None:
                method = cancelled()
                if method is not None:
                    method(why)
            self._following = followers.follow(namespace=held.namespace, queue=held.spec.queue, name=held.name,
                                               uid=held.uid, on_cancel=on_cancel, epoch=held.epoch)
            if self._stop.is_set():  # lost in that call: nothing more to follow
                self._following.close()
        if not self._stop.is_set():
            interval = held.duration_s / self._settings.renews_per_duration
            (renewals or Renewals()).add(time.monotonic() + interval, _RenewTurns(
                weakref.ref(self), self._stop, interval, held.duration_s * self._settings.renew_deadline_fraction,
                self._following, held.name))

    # -- what the work sees ------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._held.name

    @property
    def namespace(self) -> str:
        return self._held.namespace

    @property
    def epoch(self) -> int:
        """The fencing token: only grows for this task. Hand it to whatever you write to."""
        return self._held.epoch

    @property
    def holder(self) -> str:
        return self._held.holder

    @property
    def held(self) -> Held:
        return self._held

    @property
    def finished(self) -> bool:
        """True once this attempt ended: completed, failed, released or lost."""
        return self._done

    def detach(self) -> None:
        """Stop renewing here without ending the attempt: another process (a shell script
        using `tasklease renew`) takes over the renewals."""
        with self._state:
            self._done = True
        self._end_turns()

    def check(self) -> None:
        """Raise LostLease if the task is no longer ours: call it between steps of long work."""
        if self.lost.is_set():
            raise errors.LostLease(self.lost_reason)

    def payload_as(self, model: type[M]) -> M:
        """The payload as a pydantic `model`; Invalid, saying what does not fit, if it does not."""
        try:
            return model.model_validate(self.payload)
        except pydantic.ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "(the payload)"
            raise errors.Invalid(f"the payload of task {self.namespace}/{self.name} does not fit {model.__name__}: "
                                 f"{where}: {first['msg']} ({exc.error_count()} error(s))") from None

    def complete(self, result: Any = "") -> None:
        """`result`: a string as it is; a pydantic model or anything else JSON can write, as JSON."""
        if isinstance(result, str):
            text = result
        elif isinstance(result, pydantic.BaseModel):
            text = result.model_dump_json()
        else:
            try:
                text = json.dumps(result, separators=(",", ":"), allow_nan=False)
            except (TypeError, ValueError) as exc:  # a set, an object, NaN: refused, the task still held
                raise errors.Invalid(f"the result of task {self.namespace}/{self.name} is not JSON: {exc}") from None
        self._finish(lambda h: self.protocol.complete(h, text))
        self._observe("completed")

    def fail(self, message: str, *, retryable: bool = True) -> None:
        self._finish(lambda h: self.protocol.fail(h, message, retryable=retryable))
        self._observe("failed")

    def release(self, message: str = "released by its holder") -> None:
        self._finish(lambda h: self.protocol.release(h, message))
        self._observe("released")

    def give_back(self, reason: str) -> None:
        """Release the task for another agent while its work may still run (a drain's grace ran
        out, its agent closed); the work is told as of a lost lease."""
        try:
            self.release(reason)
        except errors.TaskleaseError as exc:  # lost or ended meanwhile: nothing to give back
            log.info("did not give back %s/%s: %s", self.namespace, self.name, exc)
            return
        self._lose(reason)

    # -- context manager ---------------------------------------------------------------

    def __enter__(self) -> ClaimedTask:
        if self._interrupt is not None:
            self._interrupt.enter()
        with self._state:
            self._inside = True
        self.check()  # lost before the work even started: no interrupt would come
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        with self._state:
            self._inside = False  # from here on no interrupt is delivered
        try:
            if self._interrupt is not None:
                self._interrupt.leave()
        finally:
            try:
                if not self._done and not self.lost.is_set():
                    if exc is None:
                        self.release("left the work without an outcome")
                    elif not isinstance(exc, errors.LostLease):
                        self.fail(f"{kind.__name__ if kind else 'error'}: {exc}", retryable=True)
            finally:
                self._end_turns()

    # -- internals -------------------------------------------------------------------------

    def _end_turns(self) -> None:
        """No more renewals, and no more following, from now: a later claim of the same task
        is followed afresh (a claim that ends before its first renewal has no thread to do it)."""
        if self._stop.is_set():
            return  # ended already: an ending, then leaving the `with` block
        self._stop.set()
        if self._following is not None:
            self._following.close()

    def _finish(self, write: Callable[[Held], Held]) -> None:
        with self._writing:  # the renewer skips its turn meanwhile; no state lock across requests
            self.check()
            if self._done:
                raise errors.Invalid(f"task {self.namespace}/{self.name}: attempt {self.epoch} already ended")
            tries = self._settings.finish_tries
            for attempt in range(tries):
                try:
                    held = write(self._held)
                    break
                except errors.LostLease as exc:
                    self._lose(str(exc), stop_work=False)  # the caller gets the exception itself
                    raise
                except (errors.Unreachable, errors.ServerError) as exc:
                    # The write may have been applied and only its answer lost: the retry
                    # sees a 409, re-reads, and recognises its own outcome.
                    if attempt + 1 == tries:
                        raise
                    log.warning("ending %s/%s failed (%s); retrying", self.namespace, self.name, exc)
                    time.sleep(self._settings.retry_s)
            with self._state:
                self._held, self._done = held, True
        self._end_turns()

    def _cancelled(self, why: str) -> None:
        """The Task was cancelled or deleted: the attempt is over, stop the work now (the
        operator closes the Lease; renewing it meanwhile would only be refused)."""
        with self._state:
            if self._done:
                return
        self._lose(why)

    def _renew_once(self, interval: float, renew_deadline: float) -> float | None:
        """One renewal turn: the wait before the next one, or None when renewing is over."""
        if self._done:
            return None
        # Checked before every write: after a pause (SIGSTOP, a long GC, a slow answer)
        # the lease may already belong to someone else, whatever the API server would say now.
        sent = self._monotonic()
        left = renew_deadline - (sent - self._last_ok)
        if left <= 0:
            self._lose(f"no successful renewal for {renew_deadline:.0f}s (renew deadline)")
            return None
        retry = self._settings.retry_s
        if not self._writing.acquire(blocking=False):
            return min(retry, left)  # an ending is being written: it decides, not a renewal
        try:
            if self._done:
                return None
            # A renewal answered after the deadline is worth nothing: bound the wait.
            held = self.protocol.renew(self._held, timeout=max(min(interval, left), 0.2))
            with self._state:
                self._held = held
            self._last_ok = sent  # the server saw it no earlier than we sent it
            return interval
        except errors.LostLease as exc:
            self._lose(str(exc))
            return None
        except errors.TaskleaseError as exc:
            log.warning("renewing %s/%s failed (%s); retrying", self.namespace, self.name, exc)
            return min(retry, max(left - (self._monotonic() - sent), 0.01))
        finally:
            self._writing.release()

    def _observe(self, outcome: str) -> None:
        """Tell the observer how the attempt ended: once, the first end that happened."""
        with self._state:
            if self._observer is None or self._observed:
                return
            self._observed = True
        self._observer.ended(self, outcome, self._monotonic() - self._started)

    def _lose(self, reason: str, *, stop_work: bool = True) -> None:
        """Mark the attempt lost, then tell the work: the interrupt if asked for and inside the
        block (decided under the lock `__exit__` takes, so never after the block), and the
        callbacks on a thread of their own."""
        with self._state:
            if self.lost.is_set():
                return
            self.lost_reason = reason
            self._done = True
            self.lost.set()
            if stop_work and self._interrupt is not None and self._inside:
                self._interrupt.deliver()
        self._end_turns()
        self._observe("lost")
        if not stop_work:
            return
        log.warning("lost task %s/%s (attempt %d): %s", self.namespace, self.name, self.epoch, reason)
        callbacks = list(self.on_lost)
        if callbacks:
            threading.Thread(target=self._run_callbacks, args=(callbacks,), name=f"lost-{self.name}",
                             daemon=True).start()

    def _run_callbacks(self, callbacks: list[OnLost]) -> None:
        for callback in callbacks:
            try:
                callback(self)
            except Exception:  # noqa: BLE001 - one broken callback must not keep the others from running
                log.exception("an on_lost callback of %s/%s failed", self.namespace, self.name)

    def _interrupt_due(self) -> bool:
        # No lock: the signal handler asking may run while the main thread holds `_state`.
        return self.lost.is_set() and self._inside


def interrupt_allowed() -> None:
    """Invalid unless on the main thread, the only one `claim(interrupt=True)` can interrupt."""
    if threading.current_thread() is not threading.main_thread():
        raise errors.Invalid("claim(interrupt=True) works on the main thread only: elsewhere watch "
                             "task.lost or call task.check() between steps")


class _MainThreadInterrupt:
    """`claim(interrupt=True)`: LostLease raised into the work, on the main thread only.

    While the claim's `with` block runs, SIGUSR1's Python handler is ours (a real SIGUSR1
    meanwhile goes on to the handler that was there before, if it is a Python function). A
    loss asks the interpreter to run that handler (`_thread.interrupt_main`: no signal is
    sent, so none can outlive the block or meet the default action); it raises LostLease at
    the main thread's next Python bytecode, so a blocking call (a sleep, a socket read)
    returns first. Nested claims chain their handlers."""

    def __init__(self, task: ClaimedTask) -> None:
        self._task = task
        self._previous: Any = None

    def enter(self) -> None:
        interrupt_allowed()
        self._previous = signal.signal(signal.SIGUSR1, self._handle)

    def leave(self) -> None:
        # signal.signal runs a pending handler call before it swaps: none is left for later.
        signal.signal(signal.SIGUSR1, signal.SIG_DFL if self._previous is None else self._previous)

    def deliver(self) -> None:
        _thread.interrupt_main(signal.SIGUSR1)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._task._interrupt_due():
            raise errors.LostLease(self._task.lost_reason)
        if callable(self._previous):
            self._previous(signum, frame)


@dataclass(frozen=True)
class _RenewTurns:
    """A claim's renewals. They keep only a weak reference between turns, so a claim that is
    dropped without being ended stops being renewed (and followed)."""

    ref: weakref.ReferenceType[ClaimedTask]
    stop: threading.Event
    interval: float
    renew_deadline: float
    following: Following | None
    name: str

    def first(self) -> None:
        """The first renewal is due: from now on the claim's own thread renews it."""
        if self.stop.is_set() or self.ref() is None:
            self._over()
        else:
            threading.Thread(target=self._loop, name=f"renew-{self.name}", daemon=True).start()

    def _loop(self) -> None:
        wait: float | None = 0.0
        try:
            while wait is not None and not self.stop.wait(wait):
                task = self.ref()
                wait = None if task is None else task._renew_once(self.interval, self.renew_deadline)
                del task  # no strong reference while waiting
        finally:
            self._over()

    def _over(self) -> None:
        if self.following is not None:
            self.following.close()


class Renewals:
    """One thread per agent waits for every claim's first renewal, and only then starts the
    claim's renew thread: most tasks end before it is due, and a thread started and ended
    per claim costs CPU on every task (`make bench`). A claim that ended sooner has stopped
    following its Task already (`ClaimedTask._end_turns`); its turn is dropped at the thread's
    next wake-up, with every ended one before the first still held."""

    def __init__(self) -> None:
        self._due: list[tuple[float, int, _RenewTurns]] = []
        self._order = itertools.count()  # ties in time go first come, first served
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, at: float, turns: _RenewTurns) -> None:
        with self._changed:
            heapq.heappush(self._due, (at, next(self._order), turns))
            # A forked child has no thread; a closed one may be on its way out.
            if self._thread is None or not self._thread.is_alive() or self._closed:
                self._closed = False
                self._thread = threading.Thread(target=self._run, name="renew-first-turns", daemon=True)
                self._thread.start()
            elif self._due[0][2] is turns:
                self._changed.notify()  # sooner than the thread planned to wake

    def close(self) -> None:
        """End the thread (the agent's claims have ended); a later `add` starts another."""
        with self._changed:
            self._closed = True
            self._due.clear()
            self._changed.notify()

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._closed and (not self._due or self._due[0][0] > time.monotonic()):
                    self._changed.wait(self._due[0][0] - time.monotonic() if self._due else None)
                    # Claims that ended (and stopped following then) need no turn: dropped
                    # now, not each at its own time (a wake-up per task, nearly all for nothing).
                    while self._due and self._due[0][2].stop.is_set():
                        heapq.heappop(self._due)
                if self._closed:
                    return
                turns = heapq.heappop(self._due)[2]
            turns.first()

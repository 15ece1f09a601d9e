"""The agent SDK: claim a task, keep its lease alive, stop the work the moment it is lost.

    agent = Agent.connect()
    agent.start()                      # release what an older instance of this pod held
    with agent.claim(queue="emails") as task:
        send(task.payload, fence=task.epoch)
        task.complete("sent")

Renewal runs in a background thread several times per lease duration. If a renewal is
refused (the lease was expired, cancelled or taken over), or none has succeeded for the
renew deadline (two thirds of the lease duration, on the monotonic clock, so the agent
gives up before anyone else can take over), the task is *lost*: `task.lost` is set, the
`on_lost` callbacks run, and the thread inside the task's `with` block gets a `LostLease`
exception: the main thread at once (a signal, even in a blocking call), any other thread
at its next Python bytecode (after a blocking call returns).
"""

from __future__ import annotations

import contextlib
import ctypes
import heapq
import itertools
import json
import logging
import os
import re
import signal
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from tasklease.api import errors, models, timestamps
from tasklease.protocol import members, record
from tasklease.agent.cancel import Following, share
from tasklease.agent.cancel import follow as follow_task
from tasklease.agent.discovery import Candidate, Division, Owner, QueueView, task_selector, weight
from tasklease.agent.membership import Membership, Writes
from tasklease.kube import JSON, LEASES, TASKS, Kube
from tasklease.protocol import Held, Protocol, TaskView
from tasklease.protocol.members import MemberLease

log = logging.getLogger(__name__)

RENEWS_PER_DURATION = 3
RENEW_DEADLINE_FRACTION = 2 / 3
_RETRY_S = 1.0
_CATCH_UP_S = 0.5
_SPREAD_S = 0.1  # how long a thief holds back (by its weight, once more for an idle owner); the least it waits
_LOST_ROUNDS = 3  # looks in a row that lost every race before waiting for the watch
_TRIES_PER_LOOK = 4  # a picture so stale that this many races are lost is not worth more requests
# A look's own candidates, the rest kept for the claims after it while nothing changes: about
# as many as a look finds of its own (the window holds 8 per agent at work), so that a look,
# the costliest step of a claim outside its request, is made for every 8 claims, not every 4.
_KEPT_PER_LOOK = 8
_STOP_CHECK_S = 0.5
_JOIN_S = 2.0  # the longest a first claim waits to see its own member Lease
_RECHECK_S = 60.0  # after a look whose candidates were all lost: the watch tells us sooner if anything changes
_FINISH_TRIES = 3
_CLI_PAGE = 20  # Tasks per page read by the one-shot claim: a page of 50 took a third of a GET+PUT longer
_CONTAINER = re.compile(r"[A-Za-z0-9._-]+")  # no '/', ':' or '@': they separate a holder's parts
_DEFAULT_PRIORITY = int(models.TaskSpec.model_fields["priority"].default)


@dataclass(frozen=True)
class Identity:
    """`<pod>/<instance>[@<pod uid>]`: the pod survives restarts of the process, the instance does not.

    The instance is `[<container>:]<pid>.<start time>.<random>`, so that an agent starting
    in a pod can tell a dead predecessor (release its leases at once) from a live sibling
    process in the same container (leave it alone). Agents in *different* containers of one
    pod cannot see each other's processes: each container names itself (TASKLEASE_AGENT_ID),
    and an agent judges only the instances of its own container. The pod part stays the
    pod's name, which the chart's admission policy and the operator's pod-gone path expect.

    The pod's uid (POD_UID, from the downward API) tells this pod from an earlier or later
    one of the same name (a StatefulSet's): the operator requeues a holder's tasks when *its*
    Pod goes, never because an older namesake went."""

    pod: str
    instance: str
    pod_uid: str = ""

    @classmethod
    def from_environment(cls, *, handed_over: bool = False) -> Identity:
        """`handed_over`: for a claim passed on to a shell script (`tasklease claim`), whose
        process lives on after ours: `start()` of a later agent in this pod never releases it
        (one in a later pod of the same name, another POD_UID, does: that pod is gone)."""
        pod = os.environ.get("POD_NAME") or socket.gethostname()
        pod_uid = os.environ.get("POD_UID", "")
        container = os.environ.get("TASKLEASE_AGENT_ID", "")
        if container and not _CONTAINER.fullmatch(container):
            raise errors.Invalid(f"TASKLEASE_AGENT_ID={container!r}: use letters, digits, '.', '_' and '-' "
                                 "(it names this container within its pod)")
        prefix = f"{container}:" if container else ""
        if handed_over:
            return cls(pod=pod, instance=f"{prefix}shell.{uuid.uuid4().hex[:8]}", pod_uid=pod_uid)
        pid = os.getpid()
        return cls(pod=pod, instance=f"{prefix}{pid}.{_start_ticks(pid)}.{uuid.uuid4().hex[:4]}", pod_uid=pod_uid)

    @property
    def holder(self) -> str:
        return f"{self.pod}/{self.instance}" + (f"@{record.short_uid(self.pod_uid)}" if self.pod_uid else "")


def container_of(instance: str) -> str:
    """`[<container>:]<process part>` → `<container>`; "" for an agent that names none."""
    return instance.rpartition(":")[0]


def instance_gone(instance: str) -> bool:
    """True only when we know the process that used `instance` no longer runs here: its pid
    is free or reused (another start time). Anything else (a `tasklease claim` whose shell
    script carries on, a start time this system cannot tell) counts as alive. The caller
    asks only about instances of its own container: another container's pids mean nothing here."""
    pid, _, rest = instance.rpartition(":")[2].partition(".")
    ticks = rest.partition(".")[0]
    if not pid.isdigit() or not ticks.isdigit() or not _start_ticks(os.getpid()):
        return False
    state, started = _stat(int(pid))
    # A zombie (exited, not yet reaped by its parent) runs no more code: it is gone.
    return started != ticks or state in ("Z", "X")


def _start_ticks(pid: int) -> str:
    return _stat(pid)[1]


def _stat(pid: int) -> tuple[str, str]:
    """(state, start time in clock ticks) of `pid` from /proc; empty strings when unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], fields[19]
    except (OSError, IndexError):
        return "", ""


class ClaimedTask:
    """One held attempt. Use it as a context manager: an exception fails the attempt
    (retryable), leaving without an outcome releases it.

    Renewal stops when the attempt ends, and also when this object is dropped without
    ending (the renew thread holds only a weak reference): the lease then expires.
    Locks are never held across a request: `_state` guards the fields, `_writing` lets
    one write (a renewal or the ending) at a time use the Lease's last resourceVersion."""

    def __init__(self, protocol: Protocol, held: Held, payload: dict[str, Any], *, interrupt: bool,
                 follow: bool = True, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.protocol = protocol
        self._held = held
        self.payload = payload
        self.lost = threading.Event()
        self.lost_reason = ""
        self.on_lost: list[Callable[[ClaimedTask], None]] = []
        self._interrupt = interrupt
        self._inside = False  # within the `with` block: the only time an interrupt is delivered
        self._exiting = False  # set first thing in __exit__
        self._monotonic = monotonic
        self._state = threading.Lock()
        self._writing = threading.Lock()
        self._done = False
        self._owner_thread = threading.current_thread()
        self._stop = threading.Event()
        self._last_ok = monotonic()
        # Instant cancel: hear of spec.cancel or the Task's deletion now, not at the next
        # renewal. Held weakly, like the renew thread's reference: a dropped claim is let go.
        cancelled = weakref.WeakMethod(self._cancelled)

        def on_cancel(why: str) -> None:
            method = cancelled()
            if method is not None:
                method(why)
        # A claim handed over to another process (`tasklease claim`) is not followed here.
        self._following = follow_task(protocol.kube, namespace=held.namespace, queue=held.spec.queue,
                                      name=held.name, uid=held.uid, on_cancel=on_cancel,
                                      epoch=held.epoch) if follow else None
        _FIRST_TURNS.add(time.monotonic() + held.duration_s / RENEWS_PER_DURATION,
                         _RenewTurns(weakref.ref(self), self._stop, held.duration_s, self._following, held.name))

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

    def complete(self, result: Any = "") -> None:
        text = result if isinstance(result, str) else json.dumps(result, separators=(",", ":"))
        self._finish(lambda h: self.protocol.complete(h, text))

    def fail(self, message: str, *, retryable: bool = True) -> None:
        self._finish(lambda h: self.protocol.fail(h, message, retryable=retryable))

    def release(self, message: str = "released by its holder") -> None:
        self._finish(lambda h: self.protocol.release(h, message))

    # -- context manager ---------------------------------------------------------------

    def __enter__(self) -> ClaimedTask:
        with self._state:
            self._owner_thread = threading.current_thread()
            self._inside = True
        if self._interrupt and self._owner_thread is threading.main_thread():
            _interrupts.enter(self)
        self.check()  # lost before the work even started: no interrupt would come
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._exiting = True  # a signal arriving from here on raises nothing
        try:
            with self._state:
                self._inside = False
            _interrupts.leave(self)
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
            for attempt in range(_FINISH_TRIES):
                try:
                    held = write(self._held)
                    break
                except errors.LostLease as exc:
                    self._lose(str(exc), stop_work=False)  # the caller gets the exception itself
                    raise
                except (errors.Unreachable, errors.ServerError) as exc:
                    # The write may have been applied and only its answer lost: the retry
                    # sees a 409, re-reads, and recognises its own outcome.
                    if attempt + 1 == _FINISH_TRIES:
                        raise
                    log.warning("ending %s/%s failed (%s); retrying", self.namespace, self.name, exc)
                    time.sleep(_RETRY_S)
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
        if not self._writing.acquire(blocking=False):
            return min(_RETRY_S, left)  # an ending is being written: it decides, not a renewal
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
            return min(_RETRY_S, max(left - (self._monotonic() - sent), 0.01))
        finally:
            self._writing.release()

    def _lose(self, reason: str, *, stop_work: bool = True) -> None:
        """Mark the attempt lost, then stop the work: callbacks, and the interrupt if inside."""
        with self._state:
            if self.lost.is_set():
                return
            self.lost_reason = reason
            self.lost.set()
            self._done = True
        self._end_turns()
        if not stop_work:
            return
        log.warning("lost task %s/%s (attempt %d): %s", self.namespace, self.name, self.epoch, reason)
        for callback in self.on_lost:
            callback(self)
        with self._state:
            deliver = self._interrupt and self._inside and not self._exiting
        if deliver:
            _interrupt_thread(self._owner_thread)


@dataclass(frozen=True)
class _RenewTurns:
    """A claim's renewals. They keep only a weak reference between turns, so a claim that is
    dropped without being ended stops being renewed (and followed)."""

    ref: weakref.ReferenceType[ClaimedTask]
    stop: threading.Event
    duration_s: int
    following: Following | None
    name: str

    def first(self) -> None:
        """The first renewal is due: from now on the claim's own thread renews it."""
        if self.stop.is_set() or self.ref() is None:
            self._over()
        else:
            threading.Thread(target=self._loop, name=f"renew-{self.name}", daemon=True).start()

    def _loop(self) -> None:
        interval = self.duration_s / RENEWS_PER_DURATION
        renew_deadline = self.duration_s * RENEW_DEADLINE_FRACTION
        wait: float | None = 0.0
        try:
            while wait is not None and not self.stop.wait(wait):
                task = self.ref()
                wait = None if task is None else task._renew_once(interval, renew_deadline)
                del task  # no strong reference while waiting
        finally:
            self._over()

    def _over(self) -> None:
        if self.following is not None:
            self.following.close()


class _FirstTurns:
    """One thread per process waits for every claim's first renewal, and only then starts the
    claim's renew thread: most tasks end before it is due, and a thread started and ended
    per claim cost about 0.4 ms of CPU per task (`make bench`, 16 agents). A claim that ended
    sooner has stopped following its Task already (`ClaimedTask._end_turns`); its turn is
    dropped at the thread's next wake-up, with every ended one before the first still held."""

    def __init__(self) -> None:
        self._due: list[tuple[float, int, _RenewTurns]] = []
        self._order = itertools.count()  # ties in time go first come, first served
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def add(self, at: float, turns: _RenewTurns) -> None:
        with self._changed:
            heapq.heappush(self._due, (at, next(self._order), turns))
            if self._thread is None or not self._thread.is_alive():  # a forked child has none
                self._thread = threading.Thread(target=self._run, name="renew-first-turns", daemon=True)
                self._thread.start()
            elif self._due[0][2] is turns:
                self._changed.notify()  # sooner than the thread planned to wake

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._due or self._due[0][0] > time.monotonic():
                    self._changed.wait(self._due[0][0] - time.monotonic() if self._due else None)
                    # Claims that ended (and stopped following then) need no turn: dropped
                    # now, not each at its own time (a wake-up per task, nearly all for nothing).
                    while self._due and self._due[0][2].stop.is_set():
                        heapq.heappop(self._due)
                turns = heapq.heappop(self._due)[2]
            turns.first()


_FIRST_TURNS = _FirstTurns()


class _Interrupts:
    """The one SIGUSR1 handler of the process, shared by every claim entered on the main
    thread (nested claims included): it raises LostLease for whichever of them is lost, so
    no claim's loss is dropped by another claim's handler. It is in place while a claim is
    entered, or while a work loop runs on the main thread (`kept`): not swapped in and out
    for each of the loop's tasks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._claims: list[ClaimedTask] = []
        self._loops = 0  # work loops running on the main thread
        self._previous: Any = None

    def enter(self, task: ClaimedTask) -> None:
        with self._lock:
            self._install()
            self._claims.append(task)

    def leave(self, task: ClaimedTask) -> None:
        with self._lock:
            if task in self._claims:
                self._claims.remove(task)
                self._restore()

    @contextlib.contextmanager
    def kept(self) -> Iterator[None]:
        """In place from here to the end of the block, when on the main thread (a signal
        meanwhile, with no claim of ours lost inside, does nothing)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        with self._lock:
            self._install()
            self._loops += 1
        try:
            yield
        finally:
            with self._lock:
                self._loops -= 1
                self._restore()

    def _install(self) -> None:
        """Caller holds the lock."""
        if not self._claims and not self._loops:
            self._previous = signal.signal(signal.SIGUSR1, self._raise)

    def _restore(self) -> None:
        """Caller holds the lock. Put back in the same breath as the last one leaves: a signal
        never meets the default handler (which would end the process)."""
        if not self._claims and not self._loops:
            signal.signal(signal.SIGUSR1, self._previous)

    def _raise(self, signum: int, frame: FrameType | None) -> None:
        for task in list(self._claims):
            if task.lost.is_set() and task._inside and not task._exiting:
                raise errors.LostLease(task.lost_reason)


_interrupts = _Interrupts()


def _interrupt_thread(thread: threading.Thread) -> None:
    """Raise LostLease in the thread doing the work. The main thread gets a signal, which
    also wakes it out of a blocking call (sleep, a socket read). Any other thread gets an
    asynchronous exception at its next Python bytecode: a call blocked in C (sleep, I/O)
    finishes first, so such work should call `check()` or use short timeouts."""
    if thread is threading.main_thread():
        signal.pthread_kill(thread.ident or 0, signal.SIGUSR1)
    elif thread.ident is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(errors.LostLease))


def _rank(task: JSON) -> tuple[int, str, str]:
    """Best first: higher priority, then older."""
    meta = task["metadata"]
    return (-int((task.get("spec") or {}).get("priority", _DEFAULT_PRIORITY)), meta.get("creationTimestamp", ""),
            meta["name"])


class Agent:
    """Claims tasks for one identity. Thread-safe; one QueueView (three watches) per queue, and a
    member Lease in each queue it claims from (`membership`)."""

    def __init__(self, kube: Kube, *, namespace: str | None = None, identity: Identity | None = None,
                 best_of: int = 32) -> None:
        self.kube = kube
        self.namespace = namespace or kube.namespace
        self.identity = identity or Identity.from_environment()
        self.protocol = Protocol(kube)
        self.best_of = best_of
        self._views: dict[str, QueueView] = {}
        self._unshare: list[Callable[[], None]] = []
        self._members: dict[str, Membership] = {}  # the queues we claim from: our peers there know us
        self._member_writes = Writes()  # of the memberships closed
        self._claims: weakref.WeakSet[ClaimedTask] = weakref.WeakSet()
        # Per queue: the rest of a look's own candidates, and the view's generation it was made
        # at. Until something becomes claimable (the generation moves) those still candidates
        # are still our best: only we take ours. One look serves several claims.
        self._next: dict[str, tuple[int, list[str]]] = {}
        self._views_lock = threading.Lock()

    @classmethod
    def connect(cls, *, kubeconfig: str | None = None, namespace: str | None = None, **kwargs: Any) -> Agent:
        return cls(Kube.connect(kubeconfig=kubeconfig, namespace=namespace), **kwargs)

    def start(self) -> list[str]:
        """The live check (I5): release at once every lease an older instance of this pod, or
        an earlier pod of its name, still holds, instead of letting it wait out its duration,
        and end its membership of its queues (its peers would leave its share to it). Returns
        the names of the leases released."""
        selector = f"{record.LABEL_HOLDER_POD}={record.label_value(self.identity.pod)}"
        released = []
        for obj in self.kube.list(LEASES, namespace=self.namespace, label_selector=selector).get("items", []):
            rec = record.decode(obj)
            if rec.state != record.HELD or rec.holder_pod != self.identity.pod:
                continue
            gone = self._predecessor(rec.holder)
            if not gone:
                continue
            try:
                self.protocol.release(self.protocol.held_from(rec), f"its agent restarted as {self.identity.holder}")
            except errors.LostLease:
                continue
            log.info("released %s/%s: held by %s, %s", rec.namespace, rec.name, rec.holder, gone)
            released.append(rec.name)
        for obj in self.kube.list(LEASES, namespace=self.namespace, label_selector=members.LABEL_AGENT_OF)["items"]:
            holder = members.decode(obj).holder
            if record.holder_pod(holder) == self.identity.pod and self._predecessor(holder):
                with contextlib.suppress(errors.Conflict, errors.NotFound):  # written or gone since: not ours to end
                    members.retire(self.kube, obj)
        return released

    def _predecessor(self, holder: str) -> str:
        """Why `holder`, of our pod's name, is surely gone ("" if it may not be): an earlier pod of
        our name (another uid), or an older instance in our pod whose process /proc says is gone."""
        if not holder or holder == self.identity.holder:
            return ""
        ours, theirs = record.short_uid(self.identity.pod_uid), record.holder_pod_uid(holder)
        if ours and theirs and ours != theirs:
            return "an earlier pod of this name"
        instance = record.holder_instance(holder)
        if container_of(instance) != container_of(self.identity.instance) or not instance_gone(instance):
            return ""  # another container's agent, or a sibling process in ours: not a dead predecessor
        return "an older instance of this pod"

    def claim(self, queue: str, *, timeout: float | None = None, interrupt: bool = True,
              stop: threading.Event | None = None) -> ClaimedTask:
        """Wait (watch-driven, no polling) until a task of `queue` is ours. NothingToClaim on
        timeout or when `stop` is set. `interrupt`: raise LostLease in the claiming thread if
        the lease is lost while inside the task's `with` block."""
        view = self.watch(queue)
        member = self._join(view)
        give_up = None if timeout is None else time.monotonic() + timeout
        rounds_lost = 0
        while True:
            if stop is not None and stop.is_set():
                raise errors.NothingToClaim("stopped")
            since = view.generation()
            candidates, recheck, ours = self._kept(view, since) or self._pick(view, member, stop)
            claimed, lost, rest = self._try(view, member, candidates, ours=ours, interrupt=interrupt)
            if claimed is not None:
                if rest and ours:
                    with self._views_lock:
                        self._next[queue] = (since, [task.name for task, _ in rest])
                return claimed
            wait = recheck
            if lost:
                rounds_lost += 1
                if rounds_lost < _LOST_ROUNDS and view.claimable_count():
                    continue  # the lost ones left the index: the next look offers others
                # Round after round lost: our picture is behind. Let the watch catch up (the
                # winners' writes are on their way) instead of spinning on stale candidates.
                rounds_lost, wait = 0, _CATCH_UP_S
            if give_up is not None:
                wait = min(wait, give_up - time.monotonic())
                if wait <= 0:
                    raise errors.NothingToClaim(f"nothing claimable in queue {queue!r}")
            next_ready = view.next_not_before()
            if next_ready is not None:
                wait = min(wait, max((next_ready - timestamps.now_utc()).total_seconds(), 0.05))
            if stop is not None:
                wait = min(wait, _STOP_CHECK_S)  # a local wake-up to notice `stop`, no request
            view.wait_for_change(since, wait)

    def claim_once(self, queue: str, *, interrupt: bool = False) -> ClaimedTask:
        """One look, no watch, for the stateless CLI: the queue's open Tasks are read a page at a
        time, best first within a page, and the first one that can be claimed is; the rest of
        the queue is never read. A task projected Running is skipped without a read (a task
        freed a moment ago is found by the next claim); a never-claimed one is claimed by
        creating its Lease, any other after reading its Lease."""
        for page in self.kube.list_pages(TASKS, namespace=self.namespace, field_selector=task_selector(queue),
                                         limit=_CLI_PAGE):
            # Ranked from the raw objects: only the ones tried are validated into TaskViews.
            for obj in sorted(page.get("items", []), key=_rank):
                if (obj.get("status") or {}).get("phase") == models.Phase.RUNNING.value:
                    continue
                task = TaskView.of(obj)
                rec = None if task.status_attempt == 0 else self.protocol.read(task.namespace, task.name)
                for _ in range(2):
                    try:
                        held = self.protocol.claim(task, rec, self.identity.holder)
                    except errors.NotClaimable:
                        break
                    except errors.Conflict:
                        if rec is not None:
                            break  # another agent won: the next task
                        rec = self.protocol.read(task.namespace, task.name)  # it had a Lease after all
                        if rec is None:
                            break
                        continue
                    return self._claimed(task, held, interrupt=interrupt, follow=False)
        raise errors.NothingToClaim(f"nothing claimable in queue {queue!r}")

    def work(self, queue: str, handler: Callable[[ClaimedTask], Any], *, stop: threading.Event | None = None,
             max_tasks: int | None = None, idle_timeout: float | None = None) -> int:
        """The worker loop: claim, run `handler`, complete with what it returns. Returns how many
        tasks it completed; stops on `stop`, after `max_tasks`, or after `idle_timeout` idle."""
        stop = stop or threading.Event()
        with _interrupts.kept():
            return self._work(queue, handler, stop=stop, max_tasks=max_tasks, idle_timeout=idle_timeout)

    def _work(self, queue: str, handler: Callable[[ClaimedTask], Any], *, stop: threading.Event,
              max_tasks: int | None, idle_timeout: float | None) -> int:
        done = 0
        while not stop.is_set() and (max_tasks is None or done < max_tasks):
            try:
                task = self.claim(queue, timeout=idle_timeout, stop=stop)
            except errors.NothingToClaim:
                break
            except (errors.Unreachable, errors.ServerError) as exc:
                log.warning("claiming from %s failed (%s); retrying", queue, exc)
                stop.wait(_RETRY_S)
                continue
            try:
                with task:
                    result = handler(task)
                    if not task.lost.is_set() and not task.finished:
                        task.complete(result if result is not None else "")
                        done += 1
            except errors.LostLease as exc:
                log.warning("gave up %s/%s: %s", task.namespace, task.name, exc)
            except Exception:  # noqa: BLE001 - the attempt was failed in __exit__; keep working
                log.exception("task %s/%s failed", task.namespace, task.name)
        return done

    def close(self) -> None:
        with self._views_lock:
            for member in self._members.values():
                member.close()
                self._member_writes += member.writes
            self._members.clear()
            for unshare in self._unshare:
                unshare()
            for view in self._views.values():
                view.stop()
            self._views.clear()
            self._unshare.clear()

    def watch(self, queue: str) -> QueueView:
        """Start watching `queue` now (claim does it on first use); idempotent."""
        with self._views_lock:
            view = self._views.get(queue)
            if view is None:
                view = QueueView(self.kube, namespace=self.namespace, queue=queue)
                view.start()
                self._views[queue] = view
                # Our claims in this queue hear of a cancel from this watch, not one more each.
                self._unshare.append(share(self.kube, namespace=self.namespace, queue=queue,
                                           tasks=view.task_watch, listeners=view.task_listeners))
            return view

    def join(self, queue: str) -> QueueView:
        """Watch `queue` and become one of its members now (`claim` does both on first use):
        from then on its peers leave this agent's share of the queue to it, and its first
        claim does not wait to be counted among them."""
        view = self.watch(queue)
        self._join(view)
        return view

    def member_writes(self) -> Writes:
        """How many times this agent wrote its member Leases: writes it makes besides its tasks'."""
        with self._views_lock:
            return sum((member.writes for member in self._members.values()), self._member_writes)

    def _join(self, view: QueueView) -> Membership:
        """Become a member of `view`'s queue, the first time we claim from it (a watch alone
        does not): from now on our peers leave our share of its tasks to us."""
        with self._views_lock:
            member = self._members.get(view.queue)
            joining = member is None
            if member is None:
                pod = (self.identity.pod, self.identity.pod_uid) if self.identity.pod_uid else None
                member = Membership(MemberLease(self.kube, namespace=self.namespace, queue=view.queue,
                                                holder=self.identity.holder, pod=pod),
                                    holder=self.identity.holder, holding=self._holding)
                view.task_listeners.append(member.seen)  # the operator's projections tell our claims for us
                view.join_listeners.append(member.joined)
                member.start()
                self._members[view.queue] = member
        if joining:
            # Agents that joined before us are in our picture once we are (one watch, in order):
            # claiming sooner, agents started together would each take the whole queue for theirs.
            view.wait_for_member(self.identity.holder, _JOIN_S)
        return member

    def _holding(self) -> int:
        return sum(1 for claim in list(self._claims) if not claim.finished)

    def _kept(self, view: QueueView, generation: int) -> tuple[list[Candidate], float, bool] | None:
        """The rest of the last look's own candidates still candidates, if nothing became
        claimable since."""
        with self._views_lock:
            kept = self._next.pop(view.queue, None)
        if kept is None or kept[0] != generation:
            return None
        candidates = view.still(kept[1], timestamps.now_utc())
        return (candidates, _RECHECK_S, True) if candidates else None

    def _pick(self, view: QueueView, member: Membership,
              stop: threading.Event | None) -> tuple[list[Candidate], float, bool]:
        """What to try now, how long to wait before looking again if none of it is won, and
        whether it is ours (not a thief's pick)."""
        candidates, division = self._look(view)
        if candidates and division.owner in (Owner.BUSY, Owner.IDLE):
            # Nothing of ours. An idle owner, if alive, takes its task at once: give its claim
            # time to reach us. Then its deputy goes first; the other thieves only after the
            # deputy's claim could have reached them, by our weight, one after the other.
            pause = _SPREAD_S * ((1 if division.owner is Owner.IDLE else 0) + (
                0 if division.deputy else 2 - weight(self.identity.holder, candidates[0][0].name)))
            if stop is None:
                time.sleep(pause)
            elif stop.wait(pause):
                raise errors.NothingToClaim("stopped")
            candidates, division = self._look(view)
        if division.held_back:
            member.held_back()  # our peers are likely held back by what we took untold
        if division.wait_s:
            # All that is left belongs to agents that are claiming (they take it themselves), or
            # is others' and new (their owners may have it already). Look again when that may
            # have changed; a peer that stops claiming or leaves, or a task freed, wakes us sooner.
            return [], max(division.wait_s, _SPREAD_S), False
        # Ours (a race lost over one of ours means a peer knows other peers than we do: the
        # next look offers our others), or a thief's pick.
        return candidates, _RECHECK_S, bool(division.ours)

    def _look(self, view: QueueView) -> tuple[list[Candidate], Division]:
        return view.choose(self.identity.holder, timestamps.now_utc(), window=self.best_of, limit=_KEPT_PER_LOOK)

    def _try(self, view: QueueView, member: Membership, candidates: list[Candidate], *, ours: bool,
             interrupt: bool) -> tuple[ClaimedTask | None, list[str], list[Candidate]]:
        """Claim the first candidate we can, in order; also returns the names whose race we
        lost, and the candidates not tried."""
        lost = []
        for i, (task, rec) in enumerate(candidates[:_TRIES_PER_LOOK]):
            try:
                held = self.protocol.claim(task, rec, self.identity.holder)
            except (errors.Conflict, errors.NotClaimable):
                lost.append(task.name)  # another agent won; the next candidate is another task
                view.mark_taken(task.name, rec)
                continue
            # Ours now: no watch of ours will show it (it is not free). Our peers: see `Membership.took`.
            view.mark_taken(task.name, rec)
            member.took(task.name, created=rec is None, stolen=not ours, priority=task.spec.priority)
            claimed = self._claimed(task, held, interrupt=interrupt)
            self._claims.add(claimed)
            return claimed, lost, candidates[i + 1:]
        return None, lost, []

    def _claimed(self, task: TaskView, held: Held, *, interrupt: bool, follow: bool = True) -> ClaimedTask:
        log.info("claimed %s/%s (attempt %d) as %s", task.namespace, task.name, held.epoch, held.holder)
        return ClaimedTask(self.protocol, held, task.spec.payload, interrupt=interrupt, follow=follow)

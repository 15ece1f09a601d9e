"""An in-memory tasklease for unit tests: the agent and producer API without a cluster.

    from tasklease.testing import FakeCluster

    def test_send_email() -> None:
        cluster = FakeCluster()
        cluster.producer().submit("e1", TaskSpec(queue="emails", payload={"to": "a@b.c"}))
        with cluster.agent() as agent:
            assert agent.work("emails", send, idle_timeout=0) == 1
        assert cluster.producer().get("e1").status.phase is Phase.SUCCEEDED

The claims are the SDK's own `ClaimedTask`s, and every decision (claimable or not, the next
epoch, backoff, dead-lettering, retry) is made by the protocol's own rules
(`tasklease.protocol.rules`): only the storage is imitated. What the operator does happens at
once: a cancel closes the task and its holder loses it; `expire(name)` is a lease that ran
out. Time is the injected `FakeClock`: backoffs and delayed starts wait for `clock.advance`.
A shared contract suite (the project's tests/test_contract.py) runs the same cases on this and
on a real API server.
"""

from __future__ import annotations

import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from types import TracebackType

from pydantic import BaseModel

from tasklease.agent.claimed import ClaimedTask, Renewals, interrupt_allowed
from tasklease.agent.identity import Identity
from tasklease.agent.producer import Task, same_spec
from tasklease.agent.settings import AgentSettings
from tasklease.agent.worker import Handler, Worker
from tasklease.api import errors, models
from tasklease.protocol import CLOSED, HELD, Held, LeaseRecord, TaskView
from tasklease.protocol.rules import blocker, claimed, ended, fresh_record, requeued, retried, why_not_retryable

__all__ = ["FakeAgent", "FakeClock", "FakeCluster", "FakeProducer"]


class FakeClock:
    """The fake cluster's time: it moves only when told (`advance`)."""

    def __init__(self, start: datetime | None = None) -> None:
        self._now = start or datetime(2030, 1, 1, tzinfo=UTC)
        self._listeners: list[Callable[[], None]] = []

    def now(self) -> datetime:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += timedelta(seconds=seconds)
        for listener in list(self._listeners):
            listener()


@dataclass
class _Entry:
    view: TaskView
    labels: dict[str, str]
    rec: LeaseRecord | None = None
    claim: weakref.ReferenceType[ClaimedTask] | None = field(default=None, repr=False)


class FakeCluster:
    """One namespace of Tasks and their Leases, in memory, thread-safe."""

    def __init__(self, *, namespace: str = "default", clock: FakeClock | None = None) -> None:
        self.namespace = namespace
        self.clock = clock or FakeClock()
        self._entries: dict[str, _Entry] = {}
        self._changed = threading.Condition()
        self.clock._listeners.append(self._wake)

    def agent(self, identity: Identity | None = None, *, settings: AgentSettings | None = None) -> FakeAgent:
        return FakeAgent(self, identity or Identity(pod="fake", instance=uuid.uuid4().hex[:8]), settings=settings)

    def producer(self) -> FakeProducer:
        return FakeProducer(self)

    # -- what the operator does ------------------------------------------------------------

    def expire(self, name: str) -> None:
        """The holder's lease ran out (it stopped renewing): requeued with backoff, or
        dead-lettered; the holder's claim is lost at once."""
        with self._changed:
            entry = self._entry(name)
            rec = entry.rec
            if rec is None or rec.state != HELD:
                raise errors.Invalid(f"task {self.namespace}/{name} is not held")
            entry.rec = requeued(rec, entry.view.spec, outcome="Expired", message=f"lease of {rec.holder} expired",
                                 now=self.clock.now(), backoff=True)
            self._changed.notify_all()
        self._tell_holder(entry, f"lease of {rec.holder} expired")

    # -- the store -------------------------------------------------------------------------

    def _entry(self, name: str) -> _Entry:
        """Caller holds the lock."""
        entry = self._entries.get(name)
        if entry is None:
            raise errors.NotFound(f"task {self.namespace}/{name} not found")
        return entry

    def _wake(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def _tell_holder(self, entry: _Entry, why: str) -> None:
        claim = entry.claim() if entry.claim is not None else None
        if claim is not None:
            claim._cancelled(why)

    def _claim(self, queue: str, holder: str) -> tuple[_Entry, Held] | None:
        """Caller holds the lock. The best claimable task of `queue`, claimed by `holder`."""
        now = self.clock.now()
        ready = [e for e in self._entries.values()
                 if e.view.spec.queue == queue and blocker(e.view, e.rec, now) is None]
        if not ready:
            return None
        entry = min(ready, key=lambda e: (-e.view.spec.priority, e.view.created, e.view.name))  # as agents rank
        entry.rec = claimed(entry.view, entry.rec, holder, now)
        view = entry.view
        return entry, Held(namespace=view.namespace, name=view.name, holder=holder, epoch=entry.rec.epoch,
                           spec=view.spec, uid=view.uid, record=entry.rec)

    def _as_holder(self, held: Held, change: Callable[[LeaseRecord, models.TaskSpec], LeaseRecord]) -> Held:
        """A holder's write: LostLease unless `held` still holds the task, as the API server's
        resourceVersion check and the protocol's holder check would refuse it."""
        with self._changed:
            entry = self._entries.get(held.name)
            rec = entry.rec if entry is not None else None
            if entry is None or entry.view.uid != held.uid:
                raise errors.LostLease(f"task {held.namespace}/{held.name} no longer exists")
            if rec is None or rec.state != HELD or rec.holder != held.holder or rec.epoch != held.epoch:
                raise errors.LostLease(f"task {held.namespace}/{held.name} (attempt {held.epoch}) is no longer "
                                       f"held by {held.holder}")
            entry.rec = change(rec, entry.view.spec)
            self._changed.notify_all()
            return replace(held, record=entry.rec)

    def _status(self, entry: _Entry) -> models.TaskStatus:
        """Caller holds the lock. What the operator would project into the Task's status."""
        rec, now = entry.rec, self.clock.now()
        if rec is None:
            return models.TaskStatus()
        if rec.state == CLOSED:
            phase, reason = models.Phase(rec.outcome), rec.reason
        elif rec.state == HELD:
            phase, reason = models.Phase.RUNNING, "Claimed"
        else:
            phase = models.Phase.PENDING
            reason = "BackingOff" if rec.not_before is not None and rec.not_before > now else "Requeued"
        return models.TaskStatus(phase=phase, reason=reason, holder=rec.holder, attempt=rec.epoch,
                                 claimed_at=rec.acquired_at, result=rec.result, last_error=rec.error,
                                 not_before=rec.not_before, history=list(rec.history)[-models.MAX_HISTORY:])

    def _task(self, entry: _Entry) -> Task:
        """Caller holds the lock."""
        view = entry.view
        return Task(name=view.name, namespace=view.namespace, uid=view.uid, labels=entry.labels,
                    created=view.created, spec=view.spec, status=self._status(entry))


class _Writes:
    """The claims' writes (`claimed.LeaseWriter`), into the fake cluster."""

    def __init__(self, cluster: FakeCluster) -> None:
        self._cluster = cluster

    def renew(self, held: Held, *, timeout: float = 30) -> Held:
        now = self._cluster.clock.now()
        return self._cluster._as_holder(held, lambda rec, _: replace(rec, renewed_at=now))

    def complete(self, held: Held, result: str) -> Held:
        if len(result) > models.MAX_RESULT_BYTES:
            raise errors.Invalid(f"result is {len(result)} characters; the limit is {models.MAX_RESULT_BYTES}")
        now = self._cluster.clock.now()
        return self._cluster._as_holder(held, lambda rec, _: ended(
            rec, outcome="Succeeded", now=now, close=models.Phase.SUCCEEDED.value, reason="Completed", result=result))

    def fail(self, held: Held, message: str, *, retryable: bool = True) -> Held:
        now = self._cluster.clock.now()
        if retryable:
            return self._cluster._as_holder(held, lambda rec, spec: requeued(
                rec, spec, outcome="Failed", message=message, now=now, backoff=True))
        return self._cluster._as_holder(held, lambda rec, _: ended(
            rec, outcome="Failed", now=now, message=message, close=models.Phase.FAILED.value, reason="Failed"))

    def release(self, held: Held, message: str = "released by its holder") -> Held:
        now = self._cluster.clock.now()
        return self._cluster._as_holder(held, lambda rec, spec: requeued(
            rec, spec, outcome="Released", message=message, now=now, backoff=False))


class FakeAgent:
    """`tasklease.agent.Agent`'s claiming API, on a `FakeCluster`."""

    def __init__(self, cluster: FakeCluster, identity: Identity, *, settings: AgentSettings | None = None) -> None:
        self.cluster = cluster
        self.identity = identity
        self.namespace = cluster.namespace
        self.settings = settings or AgentSettings()
        self._writes = _Writes(cluster)
        self._renewals = Renewals()
        self._claims: weakref.WeakSet[ClaimedTask] = weakref.WeakSet()
        self._closed = threading.Event()

    def start(self) -> list[str]:
        return []

    def claim(self, queue: str, *, timeout: float | None = None, interrupt: bool = False,
              stop: threading.Event | None = None) -> ClaimedTask:
        """As `Agent.claim`; `timeout` is in real seconds (the fake clock moves only when told)."""
        models.check_queue(queue)
        if interrupt:
            interrupt_allowed()
        give_up = None if timeout is None else time.monotonic() + timeout
        cluster = self.cluster
        with cluster._changed:
            while True:
                if self._closed.is_set():
                    raise errors.NothingToClaim(f"agent {self.identity.holder} is closed")
                if stop is not None and stop.is_set():
                    raise errors.NothingToClaim("stopped")
                found = cluster._claim(queue, self.identity.holder)
                if found is not None:
                    break
                wait = None if give_up is None else give_up - time.monotonic()
                if wait is not None and wait <= 0:
                    raise errors.NothingToClaim(f"nothing claimable in queue {queue!r}")
                cluster._changed.wait(self.settings.stop_check_s if wait is None else min(wait, 0.5))
        entry, held = found
        task = ClaimedTask(self._writes, held, held.spec.payload, interrupt=interrupt, renewals=self._renewals,
                           settings=self.settings)
        entry.claim = weakref.ref(task)
        self._claims.add(task)
        return task

    def work(self, queue: str, handler: Handler, *, concurrency: int = 1, stop: threading.Event | None = None,
             max_tasks: int | None = None, idle_timeout: float | None = None,
             payload_type: type[BaseModel] | None = None, drain: bool = True, grace_s: float = 30.0) -> int:
        """As `Agent.work` (the same loop, with its drain on SIGTERM on the main thread)."""
        def claim(name: str, timeout: float | None, stopped: threading.Event) -> ClaimedTask:
            return self.claim(name, timeout=timeout, stop=stopped)
        return Worker(claim, queue, handler, concurrency=concurrency, stop=stop, max_tasks=max_tasks,
                      idle_timeout=idle_timeout, payload_type=payload_type, drain=drain, grace_s=grace_s,
                      retry_s=self.settings.retry_s).run()

    def close(self) -> None:
        """As `Agent.close`: wakes waiting claims, releases what this agent holds."""
        self._closed.set()
        self.cluster._wake()
        for claim in list(self._claims):
            if not claim.finished:
                claim.give_back(f"its agent {self.identity.holder} closed")
        self._renewals.close()

    def __enter__(self) -> FakeAgent:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class FakeProducer:
    """`tasklease.agent.Producer`'s API, on a `FakeCluster`."""

    def __init__(self, cluster: FakeCluster) -> None:
        self.cluster = cluster
        self.namespace = cluster.namespace

    def submit(self, name: str | None, spec: models.TaskSpec, *, labels: Mapping[str, str] | None = None) -> Task:
        cluster = self.cluster
        if name == "":
            raise errors.Invalid("a task's name cannot be empty: pass None for a generated name")
        name = name if name is not None else f"task-{uuid.uuid4().hex[:5]}"
        with cluster._changed:
            existing = cluster._entries.get(name)
            if existing is not None:
                if same_spec(existing.view.spec.model_dump(mode="json", by_alias=True),
                             spec.model_dump(mode="json", by_alias=True)):
                    return cluster._task(existing)
                raise errors.Conflict(f"task {self.namespace}/{name} exists with another spec")
            created = cluster.clock.now().strftime("%Y-%m-%dT%H:%M:%SZ")
            view = TaskView(name=name, namespace=self.namespace, uid=str(uuid.uuid4()), spec=spec, created=created)
            entry = cluster._entries[name] = _Entry(view=view, labels=dict(labels or {}))
            cluster._changed.notify_all()
            return cluster._task(entry)

    def submit_many(self, tasks: Iterable[tuple[str, models.TaskSpec]]) -> list[Task]:
        return [self.submit(name, spec) for name, spec in tasks]

    def get(self, name: str) -> Task:
        with self.cluster._changed:
            return self.cluster._task(self.cluster._entry(name))

    def list(self, *, queue: str | None = None, phase: models.Phase | None = None) -> list[Task]:
        with self.cluster._changed:
            tasks = [self.cluster._task(e) for e in self.cluster._entries.values()]
        return [t for t in tasks
                if (queue is None or t.spec.queue == queue) and (phase is None or t.status.phase is phase)]

    def wait(self, name: str, *, timeout: float | None = None) -> Task:
        """Until the task is finished; TimeoutError after `timeout` real seconds."""
        give_up = None if timeout is None else time.monotonic() + timeout
        with self.cluster._changed:
            while True:
                task = self.cluster._task(self.cluster._entry(name))
                if task.finished:
                    return task
                left = None if give_up is None else give_up - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"task {self.namespace}/{name} is still {task.status.phase.value} "
                                       f"after {timeout:g}s")
                self.cluster._changed.wait(left)

    def cancel(self, name: str) -> Task:
        """The task ends Cancelled at once (as the operator closes it); its holder loses it."""
        cluster = self.cluster
        with cluster._changed:
            entry = cluster._entry(name)
            entry.view = replace(entry.view, spec=entry.view.spec.model_copy(update={"cancel": True}))
            rec = entry.rec
            if rec is None or rec.state != CLOSED:
                entry.rec = ended(rec or fresh_record(entry.view), outcome="Cancelled", now=cluster.clock.now(),
                                  message="cancelled", close=models.Phase.CANCELLED.value, reason="Cancelled")
            cluster._changed.notify_all()
            task = cluster._task(entry)
        cluster._tell_holder(entry, f"task {self.namespace}/{name} was cancelled")
        return task

    def retry(self, name: str) -> Task:
        """A Failed task gets a fresh budget of maxAttempts; Invalid for any other."""
        cluster = self.cluster
        with cluster._changed:
            entry = cluster._entry(name)
            reason = why_not_retryable(entry.view, entry.rec, cluster.clock.now())
            if reason is not None or entry.rec is None:
                raise errors.Invalid(f"task {self.namespace}/{name} cannot be retried: {reason}")
            entry.rec = retried(entry.rec, cluster.clock.now())
            cluster._changed.notify_all()
            return cluster._task(entry)


"""The operator's reconcile loop: watch events into the store and the work queue, each key's decision into writes.

Three parts, as controller-runtime keeps them apart: the `store.Store` (the picture of
Tasks and Leases), the `workqueue.WorkQueue` (which keys, when) and `decision` (what to
write, when to look again). Watch events (from kopf and the Reflectors, in `controller`)
only update the store and queue the task's key, after a short coalescing window (`coalesce_s`):
every event of one task within that window makes one reconcile, so a task claimed and
finished within it gets one status write. Worker threads reconcile keys one at a time per key:

1. carry out what the Task asks: cancel, or fail it at its deadline;
2. expire a held lease whose holder went silent for the Task's lease duration (observed
   time, `expiry.LeaseClock`) or whose Pod is gone: free it for the next attempt with
   backoff, or dead-letter it; undo a claim first seen while the task was not claimable by
   the API server's clock; put right a backoff the failing holder wrote (`decision.decide`);
3. project the Lease into Task.status (conditional PUT), then post the Events (the
   happy-path ones, Claimed and Succeeded, only with `happy_events`) and count the
   metrics of what changed;
4. delete a finished Task whose TTL ran out, or else schedule the key's next look in the
   work queue.

Every write is conditional on what was observed; a 409 means the world moved and a
newer watch event will bring the key back. Standby replicas keep the picture current but
do not write until they lead; becoming the leader starts a seeding thread (`activate`),
and no key is reconciled before it has listed the Leases.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from datetime import datetime

from pydantic import ValidationError

from tasklease.api import errors, models, timestamps
from tasklease.api.retry import Backoff, transient
from tasklease.operator import cleanup, decision, events, metrics, projection, timeouts
from tasklease.operator.slim import SlimTask
from tasklease.operator.store import Key, Store
from tasklease.protocol import record
from tasklease.operator.expiry import Monotonic
from tasklease.operator.workqueue import WorkQueue
from tasklease.kube import JSON, LEASES, TASKS, Kube
from tasklease.protocol import LeaseRecord, Protocol, TaskView
from tasklease.api.models import Phase

log = logging.getLogger("tasklease.operator")

_CONFLICT_RETRY_S = 0.2  # the first retry after a 409 (backoff base); other errors start at 1 s
_RETRY_CAP_S = 30.0
_SEED_TRIES = 3
_SEED_TIMEOUT_S = 3.0


class Reconciler:
    def __init__(self, kube: Kube, *, grace_s: float, namespaces: list[str] | None = None, workers: int = 2,
                 monotonic: Monotonic = time.monotonic, clock: Callable[[], datetime] | None = None,
                 component: str = "tasklease-operator", default_ttl_s: int | None = None, coalesce_s: float = 0.0,
                 happy_events: bool = False, attempt_timeout_s: int | None = None,
                 rand: Callable[[], float] = random.random) -> None:
        self.kube = kube
        self.settings = decision.Settings(grace_s=grace_s, attempt_timeout_s=attempt_timeout_s, rand=rand)
        self.namespaces = namespaces  # None: all
        # The API server's time: the Task's times are judged by it (the store stamps a
        # claim's sighting with its latest bound). A test pins one clock for both.
        self.clock = clock or kube.now
        self.protocol = Protocol(kube, clock=self.clock)
        self.monotonic = monotonic
        self.component = component
        self.default_ttl_s = default_ttl_s  # for Tasks without spec.ttlSecondsAfterFinished
        self.workers = workers
        self.happy_events = happy_events
        self.active = threading.Event()
        # Set once every Task that existed when we started leading has been reconciled once.
        self.caught_up = threading.Event()
        self._backlog: set[Key] | None = None  # None: not counted yet
        self._term = 0  # counts activations and deactivations: a seeding acts for the term it began in
        self.problem = ""  # a permanent error (no rights): readiness reports it until a write succeeds
        self.store = Store(monotonic=monotonic, clock=self.clock, late_clock=clock or kube.server_clock.latest)
        self.queue: WorkQueue[Key] = WorkQueue(monotonic, coalesce_s=coalesce_s)
        self._lock = threading.Lock()  # guards the term and the backlog; the store and the queue have their own
        self._unreadable: dict[Key, str] = {}  # Tasks whose spec cannot be read → the version reported
        metrics.OLDEST_PENDING.source = self.oldest_pending
        metrics.CLAIMABLE.source = self.claimable

    # -- intake: called from watch handlers; quick, no I/O --------------------------------

    def on_task(self, kind: str, obj: JSON) -> None:
        key = self.store.task_event(kind, obj)
        if key is not None:
            self.queue.add_soon(key)

    def on_lease(self, kind: str, obj: JSON, rec: LeaseRecord | None) -> None:
        """`rec`: `obj` read (`record.read`), once for every listener of the event."""
        key = self.store.lease_event(kind, obj, rec)
        if key is not None:
            self.queue.add_soon(key)

    def on_pod(self, kind: str, obj: JSON) -> None:
        for key in self.store.pod_event(kind, obj):
            self.queue.add(key)

    def oldest_pending(self) -> list[tuple[str, str, float]]:
        """(namespace, queue, age in seconds of its oldest Pending task) for every known queue."""
        return self.store.oldest_pending(self.clock())

    def claimable(self) -> list[tuple[str, str, int, float]]:
        """(namespace, queue, tasks claimable now, seconds the oldest has been) for every known queue."""
        return self.store.claimable(self.clock())

    # -- leadership ------------------------------------------------------------------------

    def activate(self) -> None:
        """Start acting (we lead). Returns at once: the seeding runs on its own thread, never
        on the election thread, whose renewals a slow list would delay (`_seed`)."""
        with self._lock:
            self._term += 1
            term = self._term
            self._backlog = None
            self.caught_up.clear()
        threading.Thread(target=self._seed, args=(term,), name="seed", daemon=True).start()

    def _seed(self, term: int) -> None:
        """Every held lease gets a full duration from now. The Leases are listed once first,
        so no Task is judged before its Lease is known; then the Tasks, page by page:
        `caught_up` is set once each of them has been reconciled. A leadership lost meanwhile
        (`deactivate`, a newer `activate`) ends the seeding."""
        self._seed_leases()
        with self._lock:
            if term != self._term:
                return
            self.store.restart_clocks()
            self.active.set()
            metrics.LEADER.set(1)
            for key in self.store.task_keys():  # a Lease without a Task comes back with its own next event
                self.queue.add(key)
        self._seed_tasks(term)

    def _seed_tasks(self, term: int) -> None:
        """Count the backlog: every Task that exists now, page by page, queued for a look."""
        backlog: set[Key] = set()
        scopes: list[str | None] = [*self.namespaces] if self.namespaces else [None]
        backoff = Backoff(base_s=1.0, cap_s=_RETRY_CAP_S)
        while self.active.is_set() and term == self._term:
            try:
                for ns in scopes:
                    self._seed_scope(ns, backlog)
                break
            except errors.TaskleaseError as exc:
                backlog.clear()
                if not transient(exc):
                    # No rights to list, say: health reports it; the backlog stays uncounted.
                    log.error("cannot list Tasks to count the backlog: %s", exc)
                    return
                delay = backoff.next()
                log.warning("listing Tasks to count the backlog failed (%s); retrying in %.1fs", exc, delay)
                time.sleep(delay)
        with self._lock:
            if term != self._term:
                return
            self._backlog = {k for k in backlog if self.queue.queued(k)}
            self._check_caught_up()

    def _seed_scope(self, ns: str | None, backlog: set[Key]) -> None:
        """Queue every Task of one scope, adding its key to `backlog`. A list that outlives its
        snapshot (a deep queue on a busy server) goes on at the server's current version, as
        the Reflector's does: starting over could fail the same way for ever."""
        start = ""
        while True:
            try:
                for page in self.kube.list_pages(TASKS, namespace=ns, all_namespaces=ns is None, start=start):
                    for obj in page.get("items", []):
                        key = self.store.listed_task(obj)  # the watch may be ahead: kept if newer
                        if key is not None:
                            backlog.add(key)
                            self.queue.add(key)
                return
            except errors.Gone as exc:
                if not exc.resume:
                    raise
                log.info("the list of Tasks for the backlog outlived its snapshot; listing the rest as they are now")
                start = exc.resume

    def _check_caught_up(self) -> None:
        """Caller holds the lock."""
        if self._backlog is not None and not self._backlog and self.active.is_set():
            self.caught_up.set()

    def _seed_leases(self) -> None:
        scopes: list[str | None] = [*self.namespaces] if self.namespaces else [None]
        for ns in scopes:
            for attempt in range(_SEED_TRIES):
                try:
                    listed = self.kube.list(LEASES, namespace=ns, all_namespaces=ns is None,
                                            label_selector=record.MANAGED_SELECTOR, timeout=_SEED_TIMEOUT_S)
                    break
                except errors.TaskleaseError as exc:
                    log.warning("listing Leases before acting failed (%s)%s", exc,
                                "; relying on the watch" if attempt + 1 == _SEED_TRIES else "; retrying")
            else:
                continue
            for obj in listed.get("items", []):
                self.store.lease_event("ADDED", obj, record.read(obj))  # the watch may have brought a newer one already

    def deactivate(self) -> None:
        with self._lock:
            self._term += 1  # a seeding under way stops
        self.active.clear()
        self.caught_up.clear()
        metrics.LEADER.set(0)

    # -- workers ---------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        threads = [threading.Thread(target=self._work, args=(stop,), name=f"reconcile-{i}", daemon=True)
                   for i in range(self.workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _work(self, stop: threading.Event) -> None:
        while not stop.is_set():
            key = self.queue.get()
            if key is None:
                continue
            metrics.PENDING_WORK.set(self.queue.waiting())
            try:
                if self.active.is_set():
                    self.reconcile(key)
                self.queue.forget(key)
                self.problem = ""
            except errors.Conflict:
                # Our picture is behind; the watch brings the newer version in a moment.
                self.queue.retry(key, base_s=_CONFLICT_RETRY_S)
            except errors.TaskleaseError as exc:
                if transient(exc):
                    log.warning("task %s/%s: %s; will retry", key[0], key[1], exc)
                    self.queue.retry(key, base_s=1.0)
                elif isinstance(exc, errors.Forbidden | errors.CRDMissing):
                    # Our rights or our CRD: every task is affected. Say so (readiness too);
                    # the task's next watch event brings it back.
                    self.problem = f"task {key[0]}/{key[1]}: {exc}"
                    log.error("%s; not retrying until it changes", self.problem)
                else:
                    # One object's write refused: that object's problem, not our readiness.
                    log.error("task %s/%s: %s; not retrying until it changes", key[0], key[1], exc)
            except Exception:  # noqa: BLE001 - a bug must not stop the other tasks
                log.exception("task %s/%s: reconcile failed", *key)
            finally:
                self.queue.done(key)
                with self._lock:
                    if self._backlog is not None and not self.queue.queued(key):
                        self._backlog.discard(key)
                        self._check_caught_up()

    # -- one key -------------------------------------------------------------------------------

    def reconcile(self, key: Key) -> None:
        entry, lease = self.store.entry(key)
        rec = lease.record() if lease is not None else None
        task = entry.json() if entry is not None else None
        if rec is not None and (task is None or rec.owner_uid != task["metadata"]["uid"]):
            if self.protocol.remove_orphan(rec):
                log.info("lease %s/%s: removed (%s)", rec.namespace, rec.name,
                         "its task is gone" if task is None else "it belongs to another task by this name")
                self.store.lease_left(rec)
                rec = None
        if entry is None or task is None:
            with self._lock:
                self._unreadable.pop(key, None)
            return
        try:
            view = TaskView.of(task)
        except ValidationError as exc:
            self._report_unreadable(key, task, exc)
            return
        if entry.relabel and view.status_phase not in models.TERMINAL_PHASES:  # a finished one is watched no more
            entry = self._relabel(key, entry)
            if entry is None:
                return
            task = entry.json()
        if rec is None and (_claimed_before(task) or self.store.lease_went(key)):
            rec = self._find_unlabelled(task, view)
        if rec is not None and rec.malformed:
            self._report_malformed(task, rec)
        if rec is not None and rec.owner_uid == view.uid:
            unreadable = bool(set(rec.malformed) & set(record.DROPPED_REASONS))
            # Written back without what could not be read, so that agents (and the admission
            # policy) see a Lease they can judge; or labelled with its Task's queue, which the
            # claim that created it chose (the policy cannot read the Task), or with its state
            # (a hand edit): the task's own queue's agents then see it again.
            if unreadable or rec.queue != view.spec.queue or "state-label" in rec.malformed:
                log.warning("lease %s/%s: writing it back %s", rec.namespace, rec.name,
                            "without what cannot be read" if unreadable else
                            f"in its task's queue {view.spec.queue!r}" if rec.queue != view.spec.queue else
                            f"labelled {record.LABEL_STATE}={rec.state}")
                rec = self._remember(rec, self.protocol.repair(view, rec))
        if rec is not None and rec.state == record.HELD and rec.owner_uid == view.uid:
            self.store.note_duration(key, rec, view.spec.lease_duration_seconds)
        rec = self._act(view, rec, task)
        self._project(key, entry, task, view, rec)
        self._clean_up_or_schedule(key, view, rec)

    def _relabel(self, key: Key, entry: SlimTask) -> SlimTask | None:
        """Label the Task as producers do (`labels.relabelled`): made by hand, or its priority
        changed since, it would reach every agent of its queue, or stay in a band it left.
        Returns the Task as the store now has it; None when it is gone."""
        assert entry.relabel
        log.info("task %s/%s: labelling it %s", key[0], key[1],
                 ", ".join(f"{k}={v}" for k, v in sorted(entry.relabel.items())))
        try:
            written = self.kube.merge_patch(TASKS, key[1], {"metadata": {"labels": entry.relabel}}, namespace=key[0])
        except errors.NotFound:
            self.store.task_gone(key, entry)
            return None
        self.store.wrote_task(key, entry, written)
        return self.store.entry(key)[0]

    def _find_unlabelled(self, task: JSON, view: TaskView) -> LeaseRecord | None:
        """The Lease of a task that was claimed, or whose Lease left our picture, but which our
        (label-selected) watch does not show: found by name and owner, its labels put back so
        every watch sees it again."""
        rec = self.protocol.read(task["metadata"]["namespace"], task["metadata"]["name"])
        if rec is None or rec.owner_uid != task["metadata"]["uid"]:
            return None
        log.warning("lease %s/%s: its labels were removed; putting them back", rec.namespace, rec.name)
        return self._remember(None, self.protocol.repair(view, rec))

    def _report_unreadable(self, key: Key, task: JSON, exc: ValidationError) -> None:
        """A Task whose spec the API server took and we cannot read (a time before the year 1,
        say): skipped, and said once per version (log, metric, Warning Event), never a failed
        reconcile retried for ever."""
        version = str(task["metadata"].get("resourceVersion", ""))
        with self._lock:
            if self._unreadable.get(key) == version:
                return
            self._unreadable[key] = version
        first = exc.errors()[0]
        why = f"{'.'.join(str(p) for p in first['loc']) or 'spec'}: {first['msg']}"
        log.warning("task %s/%s: skipped, its spec cannot be read (%s)", key[0], key[1], why)
        metrics.MALFORMED.labels("Task", "spec").inc()
        self._announce(task, projection.Transition("Warning", "UnreadableSpec",
                                                   f"its spec cannot be read ({why}): the task is left as it is"),
                       "", post=True)

    def _now(self) -> decision.Now:
        return decision.Now(wall=self.clock(), mono=self.monotonic())

    def _act(self, view: TaskView, rec: LeaseRecord | None, task: JSON) -> LeaseRecord | None:
        """Steps 1 and 2: at most one protocol write (`decision.decide`); returns the Lease as it now is."""
        action = decision.decide(view, rec, self.store.observed((view.namespace, view.name), rec), self._now(),
                                 self.settings)
        if action is None:
            return rec
        if isinstance(action, decision.Free):
            written = self.protocol.free(view, action.epoch)
            if written is None:  # the Task is going, or a claim created its Lease first (its event follows)
                return rec
            self._announce(task, projection.Transition(
                "Warning", "LeaseRecreated", f"{action.why}: gave it a free Lease at attempt {written.epoch}, "
                "for the agents to see"), view.spec.queue, post=True)
            return self._remember(rec, written)
        if isinstance(action, decision.Close):
            return self._remember(rec, self.protocol.close(view, rec, phase=action.phase, reason=action.reason,
                                                           message=action.message))
        assert rec is not None  # every other action changes a Lease that exists
        if isinstance(action, decision.Reschedule):
            log.info("task %s/%s: backoff of attempt %d set to end %s (the holder wrote %s)", view.namespace,
                     view.name, rec.epoch, timestamps.format_time(action.not_before),
                     timestamps.format_time(rec.not_before))
            return self._remember(rec, self.protocol.reschedule(rec, action.not_before))
        if isinstance(action, decision.Undo):
            log.warning("task %s/%s: undoing attempt %d of %s: %s", view.namespace, view.name, rec.epoch,
                        rec.holder, action.why)
            return self._remember(rec, self.protocol.undo(rec, action.why, not_before=action.not_before))
        if isinstance(action, decision.TimeOut):
            return self._remember(rec, timeouts.time_out(self.protocol, view, rec, action.ran_s,
                                                         self.settings.attempt_timeout_s))
        written = self.protocol.expire(view, rec)
        metrics.EXPIRATIONS.labels(view.namespace, view.spec.queue, action.cause).inc()
        metrics.TIME_TO_REQUEUE.labels(action.cause).observe(action.silent_s)
        log.info("task %s/%s: expired attempt %d of %s (%s, silent %.1fs)", view.namespace, view.name, rec.epoch,
                 rec.holder, action.cause, action.silent_s)
        return self._remember(rec, written)

    def _report_malformed(self, task: JSON, rec: LeaseRecord) -> None:
        """A Warning Event on the Task naming what could not be read: once per attempt and
        kind of problem (our own write-back of the same Lease is not news)."""
        if not self.store.first_report(rec):
            return
        self._announce(task, projection.Transition(
            "Warning", "MalformedLease",
            f"its Lease has fields that cannot be used ({', '.join(rec.malformed)}); they are ignored or cut"),
            "", post=True)

    def _project(self, key: Key, entry: SlimTask, task: JSON, view: TaskView, rec: LeaseRecord | None) -> None:
        """Step 3: write the status if it changed, then tell people what happened. `entry` is
        what `task` (and `view`) were decoded from: our write replaces it only if no event
        replaced it first."""
        old = models.TaskStatus.model_validate(task.get("status") or {})
        now = self.clock()
        new = projection.project(task, rec, old=old, now=now)
        queue = entry.queue
        self.store.projected(key, queue, view, rec, phase=new.phase, now=now)
        if (task.get("status") and old == new) or projection.unwritten(old, new):
            return
        try:
            written = self.kube.replace(TASKS, projection.status_write(task, new), sub="status")
        except errors.Conflict:
            metrics.STATUS_WRITES.labels("conflict").inc()
            raise
        except errors.NotFound:
            self.store.task_gone(key, entry)
            return
        except errors.TaskleaseError:
            metrics.STATUS_WRITES.labels("error").inc()
            raise
        metrics.STATUS_WRITES.labels("ok").inc()
        self.store.wrote_task(key, entry, written)
        _observe_attempts(key[0], queue, written, old, new)
        for t in projection.transitions(old, new):
            self._announce(written, t, queue, post=self.happy_events or not t.happy)

    def _announce(self, task: JSON, t: projection.Transition, queue: str, *, post: bool) -> None:
        """Log and count `t`; post it as an Event only when `post`."""
        meta = task["metadata"]
        namespace = meta["namespace"]
        counter = {"Claimed": metrics.CLAIMS, "Requeued": metrics.REQUEUES, "DeadLettered": metrics.DEAD_LETTERS,
                   "Retried": metrics.RETRIES}
        if t.reason in counter:
            counter[t.reason].labels(namespace, queue).inc()
        if t.reason in ("Succeeded", "Failed", "DeadLettered", "Cancelled") and t.message.startswith("task "):
            # The phase label holds a phase: a dead letter is a Failed completion (and a dead letter).
            phase = Phase.FAILED.value if t.reason == "DeadLettered" else t.reason
            metrics.COMPLETIONS.labels(namespace, queue, phase).inc()
        if not post:
            log.debug("task %s/%s: %s: %s", meta["namespace"], meta["name"], t.reason, t.message)
            return
        log.info("task %s/%s: %s: %s", meta["namespace"], meta["name"], t.reason, t.message)
        events.post(self.kube, task, t.type, t.reason, t.message, component=self.component, now=self.clock())

    def _clean_up_or_schedule(self, key: Key, view: TaskView, rec: LeaseRecord | None) -> None:
        """Step 4: delete a finished Task whose TTL ran out (its Lease follows: the garbage
        collector, or our orphan removal when the deletion comes back through the watch),
        conditional on the Task as we know it now (a Task changed meanwhile is kept); or else
        schedule the key's next look without any event (`decision.next_look`)."""
        entry = self.store.task(key)
        task = entry.json() if entry is not None else None
        status = models.TaskStatus.model_validate((task or {}).get("status") or {})
        delete_at = cleanup.delete_at(view, status, rec, default_ttl_s=self.default_ttl_s)
        if task is not None and delete_at is not None and delete_at <= self.clock():
            meta = task["metadata"]
            try:
                self.kube.delete(TASKS, view.name, namespace=view.namespace,
                                 preconditions={"uid": meta["uid"], "resourceVersion": meta["resourceVersion"]})
            except errors.NotFound:
                return
            metrics.CLEANUPS.labels(view.namespace, view.spec.queue).inc()
            log.info("task %s/%s: deleted %s after it finished (ttlSecondsAfterFinished)", view.namespace,
                     view.name, status.phase.value)
            return
        at = decision.next_look(view, rec, self.store.observed(key, rec), self._now(), self.settings,
                                delete_at=delete_at)
        if at is not None:
            self.queue.add_at(key, at)

    def _remember(self, before: LeaseRecord | None, after: LeaseRecord) -> LeaseRecord:
        """Our own write, handed to the store (`Store.remember`); returns it."""
        self.store.remember(before, after)
        return after


def _observe_attempts(namespace: str, queue: str, task: JSON, old: models.TaskStatus,
                      new: models.TaskStatus) -> None:
    """Queue wait (created, or the previous attempt's end, to the claim) and run time (claim
    to end) of the attempts that `new` shows first. The times come from the Lease's writers."""
    seen = {a.attempt: a for a in old.history}
    previous_end = timestamps.parse_time(task["metadata"].get("creationTimestamp"))
    for a in new.history:
        before = seen.get(a.attempt)
        if before is None and a.claimed_at is not None and previous_end is not None:
            metrics.QUEUE_WAIT.labels(namespace, queue).observe(max((a.claimed_at - previous_end).total_seconds(), 0))
        if a.outcome and not (before and before.outcome) and a.claimed_at and a.ended_at:
            if a.outcome in metrics.ATTEMPT_OUTCOMES:
                metrics.RUN_TIME.labels(namespace, queue, a.outcome).observe(
                    max((a.ended_at - a.claimed_at).total_seconds(), 0))
        previous_end = a.ended_at or previous_end


def _claimed_before(task: JSON) -> bool:
    status = task.get("status") or {}
    return bool(status.get("attempt") or status.get("holder"))

"""TaskQueues: their status, their Events, and their controls enforced against agents that ignore them.

Agents obey a queue's controls before each claim (`agent.gate`), but agents are untrusted,
so the operator checks what they did, each decision by its own observations:

- a claim it first sees `PAUSE_GRACE_S` or more after it saw the queue paused is taken back
  (`Protocol.undo`: free again, the attempt not counted);
- with `spec.maxRunning`, a holder holding more task Leases of the queue than slots
  (`protocol.slots`) for `slots.STALE_S` loses its newest claims the same way (a slot
  numbered `maxRunning` or above counts only for a claim made before that limit was seen);
- with `spec.claimsPerSecond`, claims it sees beyond the rate over `RATE_WINDOW_S` (plus
  one second's burst and `RATE_SLACK_S` of watch delay) are taken back, newest first;
- a slot held beyond its holder's task Leases, unwritten for `slots.STALE_S`, is freed
  (its agent died or did not give it back), after a fresh read of the queue's Leases.

Status (counts by phase, leases held, claimable now and since when, slots held) is written
when it changes, at most once per `STATUS_PERIOD_S` per queue. Counts by phase are the
reconciler's (the `tasklease_tasks` gauge, as last projected); claimable ones its
`claimable` (`operator.claimable`). Events on the TaskQueue: Paused, Resumed,
LimitReached (maxRunning held while tasks are claimable), ClaimUndone.

Only the leader acts (`active`); standbys keep the picture. Intake (`on_*`) is quick, no I/O.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from collections import deque
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from pydantic import ValidationError

from tasklease.api import errors, models, queues
from tasklease.api.queues import TaskQueueSpec, TaskQueueStatus
from tasklease.kube import EVENTS, JSON, LEASES, TASKQUEUES, Kube
from tasklease.kube.watching import Reflector
from tasklease.operator import metrics
from tasklease.protocol import HELD, LeaseRecord, Protocol, rate, record, slots
from tasklease.protocol.slots import Slot

log = logging.getLogger("tasklease.operator")

Where = tuple[str, str]  # (namespace, queue)
PAUSE_GRACE_S = 2.0  # a claim in flight when the pause was made may land this long after we saw it
STATUS_PERIOD_S = 1.0
TICK_S = 0.5
RATE_WINDOW_S = 10.0
RATE_SLACK_S = 2.0  # claims that reach us late arrive together: never take an honest fleet's for a breach
_SINCE_SLACK_S = 2.0


@dataclass
class _Queue:
    uid: str = ""
    name: str = ""
    generation: int = 0
    spec: TaskQueueSpec = field(default_factory=TaskQueueSpec)
    paused_at: float | None = None  # monotonic: when we saw it paused
    limit_since: float = 0.0  # monotonic: when we saw its current maxRunning
    written: TaskQueueStatus | None = None  # the status as we last wrote or read it
    version: str = ""
    last_write: float = -1e9
    at_limit: bool = False
    news: list[tuple[str, str, str]] = field(default_factory=list)  # Events to post: (type, reason, message)


@dataclass(frozen=True)
class _Held:
    queue: str
    holder: str
    epoch: int
    seen: float  # monotonic: when we first saw this claim
    news: bool  # seen as it happened, not in a first list: a claim made before a pause may arrive late then


class QueueController:
    def __init__(self, kube: Kube, *, claimable: Callable[[], list[tuple[str, str, int, float]]],
                 active: threading.Event, monotonic: Callable[[], float] = time.monotonic,
                 clock: Callable[[], datetime] | None = None, component: str = "tasklease-operator",
                 synced: Callable[[], bool] = lambda: True) -> None:
        """`synced`: whether the Task and Lease watches have listed once (what they list is no news of claims)."""
        self.kube = kube
        self.claimable = claimable
        self.active = active
        self.monotonic = monotonic
        self.clock = clock or kube.now
        self.component = component
        self.synced = synced
        self.protocol = Protocol(kube, clock=self.clock)
        self._lock = threading.Lock()
        self._queues: dict[Where, _Queue] = {}
        self._held: dict[tuple[str, str], _Held] = {}  # (namespace, lease name) → claim, held leases only
        self._slots: dict[tuple[str, str], tuple[Slot, float]] = {}  # → (slot, when this version was first seen)
        self._uncovered_since: dict[tuple[str, str, str], float] = {}  # (ns, queue, holder) → monotonic
        self._claims: dict[Where, deque[tuple[tuple[str, str], _Held]]] = {}  # claims seen, oldest first

    # -- intake ------------------------------------------------------------------------------

    def reflectors(self, namespace: str | None) -> list[Reflector]:
        return [Reflector(self.kube, TASKQUEUES, namespace=namespace, listener=self.on_queue),
                Reflector(self.kube, LEASES, namespace=namespace, listener=self.on_slot,
                          label_selector=slots.selector())]

    def on_queue(self, kind: str, obj: JSON) -> None:
        meta = obj["metadata"]
        where = (meta.get("namespace", ""), meta["name"])
        with self._lock:
            if kind == "DELETED":
                self._queues.pop(where, None)
                return
            q = self._queues.setdefault(where, _Queue())
            try:
                spec = TaskQueueSpec.model_validate(obj.get("spec") or {})
            except ValidationError as exc:
                log.warning("TaskQueue %s/%s: spec ignored: %s", *where, str(exc).splitlines()[0])
                spec = TaskQueueSpec()
            # New to us, or a change we have not answered yet (status.observedGeneration behind)
            known = bool(q.uid) or int((obj.get("status") or {}).get("observedGeneration") or 0) < int(
                meta.get("generation") or 0)
            if spec.paused and q.paused_at is None:
                q.paused_at = self.monotonic()
                if known:
                    q.news.append(("Normal", queues.PAUSED, f"queue {where[1]} paused: agents claim nothing"))
            elif not spec.paused and q.paused_at is not None:
                q.paused_at = None
                q.news.append(("Normal", queues.RESUMED, f"queue {where[1]} resumed"))
            if not q.uid or spec.max_running != q.spec.max_running:
                q.limit_since = self.monotonic()
            q.uid, q.name, q.spec = meta.get("uid", ""), meta["name"], spec
            q.generation = int(meta.get("generation") or 0)
            q.version = meta.get("resourceVersion", "")
            try:
                q.written = TaskQueueStatus.model_validate(obj.get("status") or {})
            except ValidationError:
                q.written = None

    def on_lease(self, kind: str, rec: LeaseRecord | None) -> None:
        """A task's Lease (the reconciler's watch), as read (`record.read`; None: unreadable)."""
        if rec is None:
            return
        key = (rec.namespace, rec.name)
        with self._lock:
            before = self._held.get(key)
            if kind == "DELETED" or rec.state != HELD:
                self._held.pop(key, None)
            elif before is None or (before.holder, before.epoch) != (rec.holder, rec.epoch):
                claim = self._held[key] = _Held(rec.queue, rec.holder, rec.epoch, self.monotonic(), self.synced())
                self._count_claim(key, claim)
            elif before.queue != rec.queue:
                # The claim that created the Lease chose its queue label, and the reconciler has
                # written its Task's queue back: the claim answers to that queue's controls.
                moved = self._held[key] = replace(before, queue=rec.queue)
                with contextlib.suppress(ValueError):
                    self._claims.get((rec.namespace, before.queue), deque()).remove((key, before))
                self._count_claim(key, moved)

    def _count_claim(self, key: tuple[str, str], claim: _Held) -> None:
        """Caller holds the lock. A claim seen as it happened counts against its queue's rate."""
        if (key[0], claim.queue) in self._queues and claim.news:
            self._claims.setdefault((key[0], claim.queue), deque()).append((key, claim))

    def on_slot(self, kind: str, obj: JSON) -> None:
        slot = slots.decode(obj)
        if slot is None:
            return
        key = (slot.namespace, slot.name)
        with self._lock:
            if kind == "DELETED":
                self._slots.pop(key, None)
                return
            before = self._slots.get(key)
            self._slots[key] = (slot, before[1] if before and before[0].version == slot.version else self.monotonic())

    # -- acting ------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(TICK_S):
            if not self.active.is_set():
                with self._lock:  # a standby posts nothing, not even later what it saw meanwhile
                    for q in self._queues.values():
                        q.news.clear()
                continue
            try:
                self.sync_all()
            except Exception:  # one bad turn must not end the loop; the next tick tries again
                log.exception("queue controls: a sync failed")

    def sync_all(self) -> None:
        with self._lock:
            if not self._queues:
                return  # no TaskQueue: nothing to count (the reconciler's picture is not walked)
        claimable = {(ns, q): (n, age) for ns, q, n, age in self.claimable()}
        phases = _phase_counts()
        with self._lock:
            wheres = list(self._queues)
        for where in wheres:
            self._sync(where, claimable.get(where, (0, 0.0)), phases.get(where, {}))

    def _sync(self, where: Where, claimable: tuple[int, float], phases: dict[str, int]) -> None:
        ns, name = where
        now = self.monotonic()
        with self._lock:
            q = self._queues.get(where)
            if q is None:
                return
            held = {k: h for k, h in self._held.items() if k[0] == ns and h.queue == name}
            queue_slots = [(s, seen) for (sns, _), (s, seen) in self._slots.items() if sns == ns and s.queue == name]
            spec, paused_at = q.spec, q.paused_at
        if paused_at is not None:
            for key, h in held.items():
                if h.news and h.seen >= paused_at + PAUSE_GRACE_S:
                    self._undo(q, key, h, f"claimed while queue {name} is paused")
        if spec.max_running is not None:
            self._police_limit(q, where, held, queue_slots, now)
        self._police_rate(q, where, spec.claims_per_second, now)
        running = len(held)
        at_limit = spec.max_running is not None and running >= spec.max_running and claimable[0] > 0
        with self._lock:
            if at_limit and not q.at_limit:
                q.news.append(("Normal", queues.LIMIT_REACHED,
                               f"queue {name} holds its maxRunning ({spec.max_running}) tasks; "
                               f"{claimable[0]} claimable wait"))
            q.at_limit = at_limit
            news, q.news = q.news, []
        for kind, reason, message in news:
            self._post(q, ns, kind, reason, message)
        since = (self.clock() - timedelta(seconds=round(claimable[1]))).replace(microsecond=0) if claimable[0] else None
        before = q.written.oldest_claimable_since if q.written else None
        if since is not None and before is not None and abs((since - before).total_seconds()) <= _SINCE_SLACK_S:
            since = before  # the same oldest task, give or take rounding: no write for that
        status = TaskQueueStatus(
            pending=phases.get(models.Phase.PENDING.value, 0), running=running,
            succeeded=phases.get(models.Phase.SUCCEEDED.value, 0), failed=phases.get(models.Phase.FAILED.value, 0),
            cancelled=phases.get(models.Phase.CANCELLED.value, 0), claimable=claimable[0],
            oldest_claimable_since=since, slots_held=sum(1 for s, _ in queue_slots if s.holder),
            observed_generation=q.generation)
        if status != q.written and now - q.last_write >= STATUS_PERIOD_S:
            self._write_status(q, ns, status, now)

    def _police_limit(self, q: _Queue, where: Where, held: dict[tuple[str, str], _Held],
                      queue_slots: list[tuple[Slot, float]], now: float) -> None:
        ns, name = where
        held_by: dict[str, int] = {}
        for h in held.values():
            held_by[h.holder] = held_by.get(h.holder, 0) + 1
        current = [s for s, _ in queue_slots]
        over = slots.uncovered(self._covering(current, held, q), held_by)
        with self._lock:
            for gone in [k for k in self._uncovered_since if k[:2] == where and k[2] not in over]:
                del self._uncovered_since[gone]
            due = [h for h in over if now - self._uncovered_since.setdefault((ns, name, h), now) >= slots.STALE_S]
        if due:  # a fresh read of the slots: our watch of them may lag
            fresh = [s for obj in self.kube.list(LEASES, namespace=ns, label_selector=slots.selector(name))["items"]
                     if (s := slots.decode(obj)) is not None]
            over = slots.uncovered(self._covering(fresh, held, q), held_by)
        for holder in (h for h in due if h in over):
            newest = sorted(((k, h) for k, h in held.items() if h.holder == holder), key=lambda kh: -kh[1].seen)
            for key, h in newest[:over[holder]]:
                self._undo(q, key, h, f"claimed without a slot of queue {name} (maxRunning {q.spec.max_running})")
        spare = slots.surplus(current, held_by)
        stale = [s for s, seen in queue_slots if s.holder in spare and now - seen >= slots.STALE_S]
        if not stale:
            return
        # A fresh read: a claim made under a slot since our watch last spoke is in it.
        fresh_held: dict[str, int] = {}
        for obj in self.kube.list(LEASES, namespace=ns, label_selector=f"{record.LABEL_QUEUE}={name}")["items"]:
            rec = record.decode(obj, whole=False)
            if rec.state == HELD:
                fresh_held[rec.holder] = fresh_held.get(rec.holder, 0) + 1
        spare = slots.surplus(current, fresh_held)
        for slot in stale:
            if spare.get(slot.holder, 0) > 0 and slots.release(self.kube, slot):
                spare[slot.holder] -= 1
                log.info("queue %s/%s: freed slot %s of %s (no task of its holder needs it)", ns, name, slot.name,
                         slot.holder)

    @staticmethod
    def _covering(queue_slots: list[Slot], held: dict[tuple[str, str], _Held], q: _Queue) -> list[Slot]:
        """The slots that cover claims: those below maxRunning; one above it (`maxRunning` was
        lowered, or an agent made it) only a claim made before we saw the current limit, one
        of its holder's each: lowering the limit stops no running task, and a slot numbered
        above the limit lets no one claim more."""
        limit = q.spec.max_running or 0
        older: dict[str, int] = {}
        for h in held.values():
            if not h.news or h.seen < q.limit_since:
                older[h.holder] = older.get(h.holder, 0) + 1
        covering = []
        for slot in sorted(queue_slots, key=lambda s: s.index):
            if slot.index < limit:
                covering.append(slot)
            elif slot.holder and older.get(slot.holder, 0) > 0:
                older[slot.holder] -= 1
                covering.append(slot)
        return covering

    def _police_rate(self, q: _Queue, where: Where, per_s: float | None, now: float) -> None:
        with self._lock:
            seen = self._claims.get(where)
            if seen is None:
                return
            while seen and now - seen[0][1].seen > RATE_WINDOW_S:
                seen.popleft()
            if per_s is None:
                seen.clear()
                return
            allowed = rate_allowance(per_s)
            excess = list(seen)[allowed:]
            for item in excess:
                seen.remove(item)  # judged once
        for key, claim in reversed(excess):
            self._undo(q, key, claim, f"claimed beyond queue {where[1]}'s rate of {per_s:g} claims per second")

    def _undo(self, q: _Queue, key: tuple[str, str], h: _Held, why: str) -> None:
        rec = self.protocol.read(*key)
        if rec is None or rec.state != HELD or (rec.holder, rec.epoch) != (h.holder, h.epoch):
            return
        try:
            self.protocol.undo(rec, why, not_before=None)
        except (errors.Conflict, errors.NotFound):
            return  # it moved: the next look judges it again
        log.info("task %s/%s: claim by %s undone: %s", key[0], key[1], h.holder, why)
        self._post(q, key[0], "Warning", queues.CLAIM_UNDONE, f"task {key[1]}: claim by {h.holder} undone: {why}")

    def _write_status(self, q: _Queue, namespace: str, status: TaskQueueStatus, now: float) -> None:
        body = {"apiVersion": f"{models.GROUP}/{models.VERSION}", "kind": queues.QUEUE_KIND,
                "metadata": {"name": q.name, "namespace": namespace, "resourceVersion": q.version},
                "status": status.model_dump(mode="json", by_alias=True, exclude_none=True)}
        try:
            written = self.kube.replace(TASKQUEUES, body, sub="status", timeout=10)
        except (errors.Conflict, errors.NotFound):
            return  # our picture is behind: the watch brings the newer version
        except errors.TaskleaseError as exc:
            log.warning("TaskQueue %s/%s: status not written: %s", namespace, q.name, exc)
            return
        with self._lock:
            q.written, q.last_write = status, now
            q.version = written["metadata"]["resourceVersion"]

    def _post(self, q: _Queue, namespace: str, kind: str, reason: str, message: str) -> None:
        if not q.uid:
            return
        now = self.clock().strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{q.name}.", "namespace": namespace},
            "involvedObject": {"apiVersion": f"{models.GROUP}/{models.VERSION}", "kind": queues.QUEUE_KIND,
                               "name": q.name, "namespace": namespace, "uid": q.uid},
            "reason": reason, "message": message[:1024], "type": kind,
            "source": {"component": self.component}, "reportingComponent": self.component,
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        try:
            self.kube.create(EVENTS, event, namespace=namespace)
            metrics.EVENTS_POSTED.inc()
        except errors.TaskleaseError as exc:
            log.warning("could not post event %s on TaskQueue %s/%s: %s", reason, namespace, q.name, exc)


def rate_allowance(per_s: float) -> int:
    """The most claims an honest fleet can make within RATE_WINDOW_S as we see them: the
    window's claims and the watch delay's, the bucket's burst (at least one claim), one at
    the window's edge."""
    return math.floor(per_s * (RATE_WINDOW_S + RATE_SLACK_S) + max(per_s * rate.BURST_S, 1.0)) + 1


def _phase_counts() -> dict[Where, dict[str, int]]:
    """Tasks by queue and phase, as the reconciler last projected them (its gauge)."""
    out: dict[Where, dict[str, int]] = {}
    for family in metrics.TASKS.collect():
        for sample in family.samples:
            where = (sample.labels["namespace"], sample.labels["queue"])
            out.setdefault(where, {})[sample.labels["phase"]] = int(sample.value)
    return out

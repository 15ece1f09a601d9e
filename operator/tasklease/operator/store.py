"""The operator's picture of the Tasks and Leases it reconciles, kept apart from reconciling them.

Watch events (and the leader's seeding lists) go in through `task_event`, `lease_event` and
`pod_event`; each returns the keys whose reconcile the news calls for, and the caller
queues them. The reconciler reads `entry` (a task and its Lease, as one consistent pair)
and `observed` (what our own clocks saw of that Lease, for `decision`), and hands back what
it wrote (`remember`, `wrote_task`) and what it projected (`projected`).

- Kept slim (`slim.SlimTask`, `slim.SlimLease`): memory per task is what decisions need; the
  last `_WARM` of each kind stored are kept as read (`slim.Warm`), the rest deflated.
- A version no newer than the one held is ignored: a list that outlived its snapshot replays
  older news of objects it listed later, and a seeding list can lag the watch. Versions
  are compared as the API server makes them (etcd revisions, increasing across every
  object, so a recreated object's are newer too); one that is not a number counts as newer.
  A deletion is always applied.
- An object that cannot be read is skipped, logged and counted (`tasklease_malformed_objects_total`);
  a Lease version that cannot be read drops the one held, so it never stands in for current.
- The observation clocks (`expiry.LeaseClock`, `timeouts.AttemptClock`, the `Sighting`s)
  live here because every Lease version feeds them as it arrives.

Thread-safe behind one lock, no API calls, clocks injected.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from datetime import datetime
from typing import Any

from tasklease.api import timestamps
from tasklease.api.models import Phase
from tasklease.kube import JSON
from tasklease.operator import decision, metrics, timeouts
from tasklease.operator.claimable import Waits
from tasklease.operator.expiry import LeaseClock, Monotonic, PodsGone
from tasklease.operator.slim import SlimLease, SlimTask, Warm, slim, slim_lease, version
from tasklease.protocol import LeaseRecord, TaskView, record

log = logging.getLogger("tasklease.operator")

Key = tuple[str, str]  # (namespace, name)
Where = tuple[str, str]  # (namespace, queue)
_TERMINATED_POD_PHASES = ("Succeeded", "Failed")
# A gone Pod is remembered this long (longer than any lease duration), then forgotten.
_POD_MEMORY_S = 2 * 3600.0
# Tasks (and as many Leases) kept warm: more than the tasks a busy queue changes between
# two reconciles of one of them.
_WARM = 256


class Store:
    def __init__(self, *, monotonic: Monotonic, clock: Callable[[], datetime],
                 late_clock: Callable[[], datetime]) -> None:
        # A claim's sighting is stamped with the API server's latest bound (a claim is never
        # taken for early wrongly), the rest with its earliest, as the agents judge.
        self.clock = clock
        self.late_clock = late_clock
        self._tasks: dict[Key, SlimTask] = {}
        self._leases: dict[Key, SlimLease] = {}
        self._warm_tasks, self._warm_leases = Warm[SlimTask](_WARM), Warm[SlimLease](_WARM)
        self._sightings: dict[Key, decision.Sighting] = {}
        self._reported: dict[Key, tuple[int, frozenset[str]]] = {}  # (epoch, what) an Event was posted for
        self._pods_gone: PodsGone[Key] = PodsGone(monotonic, memory_s=_POD_MEMORY_S)  # deleted or terminated Pods
        self._lease_clock: LeaseClock[Key] = LeaseClock(monotonic)
        self._attempts: timeouts.AttemptClock[Key] = timeouts.AttemptClock(monotonic)
        self._phase_values: dict[Where, tuple[str, str]] = {}  # one (queue, phase) per value, shared by its tasks
        self._queues: set[Where] = set()  # seen: their series exist
        self._waits: Waits[Key] = Waits()  # for the claimable-now gauges
        self._gone: dict[Key, dict[str, int]] = {}  # `decision.Observed.gone`: owner uid → highest epoch
        self._lock = threading.Lock()

    # -- intake: quick, no I/O -------------------------------------------------------------

    def task_event(self, kind: str, obj: JSON) -> Key | None:
        """A Task's watch event (ADDED, MODIFIED or DELETED); the key to reconcile, or None
        when there is nothing new: an object that cannot be read, or a version no newer than
        the one held (above all our own status write, coming back through the watch: the
        reconcile that wrote it has already looked)."""
        taken = self._take_task(kind, obj)
        return taken[0] if taken is not None and taken[1] else None

    def listed_task(self, obj: JSON) -> Key | None:
        """A Task from a seeding list: kept if newer than the one held; its key whenever it
        can be read (every listed task is looked at once)."""
        taken = self._take_task("ADDED", obj)
        return taken[0] if taken is not None else None

    def _take_task(self, kind: str, obj: JSON) -> tuple[Key, bool] | None:
        """(key, whether it was news), or None when it cannot be read. An old version is
        not decoded at all: at a high rate most Task events are our own writes."""
        try:
            key = _key(obj)
            incoming = version(str(obj["metadata"].get("resourceVersion", "")))
            with self._lock:
                held = self._tasks.get(key)
            if kind != "DELETED" and held is not None and _older(incoming, held.version):
                return key, False
            entry = None if kind == "DELETED" else slim(obj)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            _skip("Task", obj, exc)
            return None
        with self._lock:
            held = self._tasks.get(key)
            if entry is None:
                self._tasks.pop(key, None)
                self._warm_tasks.discard(key)
                self._gone.pop(key, None)
                if held is not None:
                    self._set_phase(key, held, None)
                return key, True
            if held is not None and _older(entry.version, held.version):
                return key, False
            if held is not None:
                entry.projected = held.projected
            entry.key = self._shared(key)
            self._tasks[entry.key] = entry
            cooling = self._warm_tasks.add(entry.key, entry)
            where = (key[0], entry.queue)
            if where not in self._queues:
                self._queues.add(where)
                metrics.known_queue(*where)
        _cool(cooling)
        return key, True

    def lease_event(self, kind: str, obj: JSON, rec: LeaseRecord | None) -> Key | None:
        """A Lease's watch event, and `rec` read from it (`record.read`); the key of its task to
        reconcile, or None when even its name cannot be read or the version is no newer than
        the one held."""
        try:
            key = _key(obj)
        except (KeyError, TypeError) as exc:
            _skip("Lease", obj, exc)
            return None
        incoming = version(str(obj["metadata"].get("resourceVersion", "")))
        with self._lock:
            held = self._leases.get(key)
            if kind != "DELETED" and held is not None and _older(incoming, version(held.resource_version)):
                return None  # nothing new (our own write coming back, a list behind the watch)
            if rec is None and kind != "DELETED":
                log.warning("lease %s/%s cannot be read at all; ignoring it", *key)
                metrics.MALFORMED.labels("Lease", "unreadable").inc()
            if kind == "DELETED" or rec is None:
                self._forget_lease(key)  # a version we cannot read must not stay held as if current
                if kind == "DELETED" and rec is not None:
                    self._left(key, rec)
                return key
            if rec.malformed:
                log.warning("lease %s/%s: ignoring what cannot be read of it (%s)", *key, ", ".join(rec.malformed))
                for reason in rec.malformed:
                    metrics.MALFORMED.labels("Lease", reason).inc()
            cooling = self._cache(key, rec)
        _cool(cooling)
        return key

    def lease_left(self, rec: LeaseRecord) -> None:
        """`rec` is gone (we deleted it): as its DELETED event will say, said before it comes."""
        with self._lock:
            self._left((rec.namespace, rec.name), rec)

    def lease_went(self, key: Key) -> bool:
        """Whether a Lease of `key`'s name left our picture, and none came since (`_left`)."""
        with self._lock:
            return key in self._gone

    def _left(self, key: Key, rec: LeaseRecord) -> None:
        """Caller holds the lock. Remembered while the Task is held, until a Lease of its name comes."""
        if key in self._tasks:
            owners = self._gone.setdefault(key, {})
            owners[rec.owner_uid] = max(owners.get(rec.owner_uid, 0), rec.epoch)

    def pod_event(self, kind: str, obj: JSON) -> list[Key]:
        """An agent Pod's event: the keys of the Leases held by it when it went away."""
        meta = obj["metadata"]
        pod = (meta["namespace"], meta["name"])
        alive = kind != "DELETED" and (obj.get("status") or {}).get("phase") not in _TERMINATED_POD_PHASES
        with self._lock:
            if alive:
                # A new pod of the same name (a StatefulSet's) is not the one that went away.
                self._pods_gone.alive(pod)
                return []
            if not self._pods_gone.gone(pod, record.short_uid(str(meta.get("uid", "")))):
                return []
            return [key for key, lease in self._leases.items() if key[0] == pod[0] and lease.held_by_pod == pod[1]]

    # -- reads -----------------------------------------------------------------------------

    def entry(self, key: Key) -> tuple[SlimTask | None, SlimLease | None]:
        """The task and its Lease as held now, read together."""
        with self._lock:
            return self._tasks.get(key), self._leases.get(key)

    def task(self, key: Key) -> SlimTask | None:
        with self._lock:
            return self._tasks.get(key)

    def task_keys(self) -> list[Key]:
        with self._lock:
            return list(self._tasks)

    def task_names(self, namespace: str | None) -> list[str]:
        """The Tasks held, named as a Reflector of `namespace` (None: all) names them: its
        `known`, so that its store stays empty and a relist still reports what was deleted."""
        with self._lock:
            return _names(self._tasks, namespace)

    def lease_names(self, namespace: str | None) -> list[str]:
        """The Leases held, as `task_names` names the Tasks."""
        with self._lock:
            return _names(self._leases, namespace)

    def holds_task(self, namespace: str | None, name: str) -> bool:
        """Whether `name` is in `task_names(namespace)`, without making it: a Reflector's
        `knows`, which a relist asks for each name it did not bring again."""
        with self._lock:
            return _key_of(namespace, name) in self._tasks

    def holds_lease(self, namespace: str | None, name: str) -> bool:
        """Whether `name` is in `lease_names(namespace)`, as `holds_task`."""
        with self._lock:
            return _key_of(namespace, name) in self._leases

    def note_duration(self, key: Key, rec: LeaseRecord, duration_s: int) -> None:
        """The Task's spec.leaseDurationSeconds while `rec` holds it (`timeouts.Sighting.duration_s`)."""
        with self._lock:
            self._attempts.note_duration(key, rec.epoch, duration_s)

    def observed(self, key: Key, rec: LeaseRecord | None) -> decision.Observed:
        """What our clocks saw of `rec` (the Lease `entry` gave), for `decision`."""
        held = rec is not None and rec.state == record.HELD
        with self._lock:
            seen = self._lease_clock.seen(key)
            attempt = self._attempts.sighting(key)
            # The sighting of this very attempt, if it is held.
            this = attempt if held and attempt is not None and rec is not None and attempt.epoch == rec.epoch else None
            first_seen = self._lease_clock.first_seen(key)
            return decision.Observed(
                sighting=self._sightings.get(key),
                held_since=seen.first_seen if held and seen is not None and rec is not None
                and seen.resource_version == rec.resource_version else None,
                silent_s=self._lease_clock.silent_for(key),
                attempt_since=this.first_seen if this is not None else None,
                duration_s=this.duration_s if this is not None else 0,
                # The holder's own Pod went away after we saw this claim (`PodsGone`).
                pod_gone=held and rec is not None and first_seen is not None and self._pods_gone.took(
                    (rec.namespace, rec.holder_pod), rec.holder_pod_uid, first_seen=first_seen),
                gone=tuple(self._gone.get(key, {}).items()))

    def oldest_pending(self, now: datetime) -> list[tuple[str, str, float]]:
        """(namespace, queue, age in seconds of its oldest Pending task) for every known queue."""
        with self._lock:
            oldest = dict.fromkeys(self._queues, 0.0)
            for key, task in self._tasks.items():
                if task.projected is None or task.projected[1] != Phase.PENDING.value:
                    continue
                created = timestamps.parse_time(task.created) or now
                where = (key[0], task.projected[0])
                oldest[where] = max(oldest.get(where, 0.0), (now - created).total_seconds())
        return [(ns, queue, age) for (ns, queue), age in sorted(oldest.items())]

    def claimable(self, now: datetime) -> list[tuple[str, str, int, float]]:
        """(namespace, queue, tasks claimable now, seconds the oldest has been) for every known queue."""
        with self._lock:
            pending = ((key, (key[0], task.projected[0]), task.created) for key, task in self._tasks.items()
                       if task.projected is not None and task.projected[1] == Phase.PENDING.value)
            return self._waits.per_queue(self._queues, pending, now)

    # -- what the reconciler did -----------------------------------------------------------

    def remember(self, before: LeaseRecord | None, after: LeaseRecord) -> None:
        """Our own write of a Lease, unless the watch already brought something newer (say,
        the next claim): that must keep its own observation time, or it would never expire."""
        key = (after.namespace, after.name)
        cooling = None
        with self._lock:
            current = self._leases.get(key)
            if current is None or before is None or current.resource_version == before.resource_version:
                cooling = self._cache(key, after)
        _cool(cooling)

    def wrote_task(self, key: Key, entry: SlimTask, written: JSON) -> None:
        """Our own status write of the Task `entry` held: kept only if no event replaced
        `entry` meanwhile (a cancel made right after our write must not be hidden by it)."""
        kept = slim(written)
        cooling = None
        with self._lock:
            if self._tasks.get(key) is entry:
                kept.projected, kept.key = entry.projected, entry.key
                self._tasks[key] = kept
                cooling = self._warm_tasks.add(key, kept)
        _cool(cooling)

    def task_gone(self, key: Key, entry: SlimTask) -> None:
        """The Task `entry` held was not found (a relist may not report it as deleted): forget it."""
        with self._lock:
            if self._tasks.get(key) is entry:
                self._tasks.pop(key)
                self._warm_tasks.discard(key)
                self._gone.pop(key, None)
                self._set_phase(key, entry, None)

    def projected(self, key: Key, queue: str, view: TaskView, rec: LeaseRecord | None, *, phase: Phase,
                  now: datetime) -> None:
        """The phase a reconcile projected for the task (the tasks-by-phase gauge), and
        whether it is claimable by waiting (the claimable-now gauges). A task deleted
        meanwhile is not counted again."""
        with self._lock:
            task = self._tasks.get(key)
            if task is None:
                return
            value = (queue, phase.value)
            self._set_phase(key, task, self._phase_values.setdefault(value, value))
            self._waits.note(key, view, rec, pending=phase is Phase.PENDING, now=now)

    def first_report(self, rec: LeaseRecord) -> bool:
        """True the first time this attempt of the Lease shows these kinds of malformed
        fields (our own write-back of the same Lease is not news)."""
        key = (rec.namespace, rec.name)
        with self._lock:
            epoch, told = self._reported.get(key, (rec.epoch, frozenset()))
            told = told if epoch == rec.epoch else frozenset()
            if told.issuperset(rec.malformed):
                return False
            self._reported[key] = (rec.epoch, told | set(rec.malformed))
            return True

    def restart_clocks(self) -> None:
        """Every held lease gets a full duration from now (we start leading)."""
        with self._lock:
            self._lease_clock.restart_all()

    # -- under the lock --------------------------------------------------------------------

    def _shared(self, key: Key) -> Key:
        """The one (namespace, name) tuple held for `key`'s task and its Lease: a second
        tuple, and a second copy of the name, would cost every task claimed once."""
        for held in (self._tasks.get(key), self._leases.get(key)):
            if held is not None and held.key is not None:
                return held.key
        return key

    def _cache(self, key: Key, rec: LeaseRecord) -> SlimLease | None:
        """Caller holds the lock. What must cool now (`_cool`, once the lock is released)."""
        lease = slim_lease(rec)
        self._gone.pop(key, None)
        lease.key = self._shared(key)
        self._leases[lease.key] = lease
        cooling = self._warm_leases.add(lease.key, lease)
        before = self._sightings.get(key)
        if before is None or (before.epoch, before.state) != (rec.epoch, rec.state):
            if rec.state == record.CLOSED:
                self._sightings.pop(key, None)
            else:
                held = rec.state == record.HELD
                self._sightings[key] = decision.Sighting(
                    rec.epoch, rec.state, self.late_clock() if held else self.clock(),
                    witnessed=not held and before is not None and before.state == record.HELD
                    and before.epoch == rec.epoch)
        self._attempts.observe(key, rec)  # an attempt's timeout runs from when we first see its claim
        if rec.state == record.HELD:
            # The moment we first see this version is what expiry is measured from.
            self._lease_clock.observe(key, rec.resource_version)
        else:
            self._lease_clock.forget(key)
        return cooling

    def _forget_lease(self, key: Key) -> None:
        self._leases.pop(key, None)
        self._warm_leases.discard(key)
        self._sightings.pop(key, None)
        self._reported.pop(key, None)
        self._lease_clock.forget(key)
        self._attempts.forget(key)

    def _set_phase(self, key: Key, task: SlimTask, value: tuple[str, str] | None) -> None:
        """Keeps the tasks-by-queue-and-phase gauge exact."""
        before, task.projected = task.projected, value
        if value is None:
            self._waits.forget(key)
        if before is not None:
            metrics.TASKS.labels(key[0], *before).dec()
        if value is not None:
            metrics.TASKS.labels(key[0], *value).inc()


def _cool(obj: SlimTask | SlimLease | None) -> None:
    """Deflate what the store stopped keeping warm, outside its lock: deflating takes longer
    than anything done under it."""
    if obj is not None:
        obj.cool()


def _older(incoming: int, held: int) -> bool:
    """`incoming` is older than (or the same as) `held`; a version that is no number (-1) is not."""
    return incoming >= 0 and held >= 0 and incoming <= held


def _skip(kind: str, obj: Any, exc: Exception) -> None:
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    meta = meta if isinstance(meta, dict) else {}
    log.warning("skipping a %s that cannot be read (%s/%s): %r", kind, meta.get("namespace"), meta.get("name"), exc)
    metrics.MALFORMED.labels(kind, "unreadable").inc()


def _names(held: dict[Key, Any], namespace: str | None) -> list[str]:
    if namespace is not None:
        return [name for ns, name in held if ns == namespace]
    return [f"{ns}/{name}" for ns, name in held]


def _key_of(namespace: str | None, name: str) -> Key:
    """The key of a name as `_names` gives it."""
    if namespace is not None:
        return (namespace, name)
    ns, _, short = name.partition("/")
    return (ns, short)


def _key(obj: JSON) -> Key:
    meta: dict[str, Any] = obj["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    if not isinstance(namespace, str) or not isinstance(name, str):
        raise TypeError("metadata.namespace and metadata.name must be strings")
    return (sys.intern(namespace), name)  # one namespace string for all its keys

"""Pod-bound leases: the operator keeps a lease alive for as long as its holder's Pod runs.

A holder that cannot renew (a shell script in a long `sleep`, a program blocked in native
code) binds its lease to its own Pod: `tasklease claim --pod-bound` writes the Pod's uid
into the annotation `tasklease.dev/pod-bound`, and the admission policy accepts only the
writer's own Pod's uid there (docs/pod-bound.md). From then on the operator:

- renews the lease (renewTime only, `Protocol.keep_alive`) every third of the Task's
  `spec.leaseDurationSeconds`, measured on its own monotonic clock from when it first saw
  the Lease's current version, while it sees that Pod Running with no container restarted
  or stopped since it first saw the binding;
- expires it at once when the Pod goes (deleted, terminated, or a namesake with another
  uid in its place) or a container restarts or stops;
- stops renewing while the Pod is being deleted: the holder may still end its attempt
  within the grace period, or the lease runs out.

A Pod the operator cannot see (not labelled `tasklease.dev/agent=true`) gets no renewals:
its lease lives only as long as its holder renews it. The attempt timeout
(`timeouts.AttemptClock`, in the reconciler) still ends every attempt, renewed or not.

`Bindings` decides, without I/O and on an injected clock; `PodBound` carries the
decisions out on its own thread, only while this replica leads, each write conditional
on the Lease version it saw. The reconciler needs to know nothing of it: a renewal is a
new Lease version (its expiry clock starts again), an expiry a Lease freed like any other.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import Enum

from tasklease.api import errors
from tasklease.kube import JSON, TASKS, Kube
from tasklease.operator import events, metrics
from tasklease.operator.expiry import DeadlineQueue, Monotonic
from tasklease.protocol import LeaseRecord, Protocol, TaskView, record

log = logging.getLogger("tasklease.operator")

Key = tuple[str, str]  # (namespace, name) of a task's Lease, or of a Pod
RENEWALS_PER_DURATION = 3
_RETRY_S = 1.0  # after a failed write, or while this replica does not lead
_GONE_PHASES = ("Succeeded", "Failed")


@dataclass(frozen=True)
class PodState:
    """What decides whether a bound lease lives: the Pod's identity, phase, and per container
    its restart count and whether it runs."""

    uid: str
    phase: str
    deleting: bool
    containers: Mapping[str, tuple[int, bool]]  # name → (restartCount, running)


def pod_state(pod: JSON) -> PodState:
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    containers = {str(c.get("name", "")): (int(c.get("restartCount") or 0), "running" in (c.get("state") or {}))
                  for c in status.get("containerStatuses") or []}
    return PodState(uid=str(meta.get("uid", "")), phase=str(status.get("phase", "")),
                    deleting=bool(meta.get("deletionTimestamp")), containers=containers)


@dataclass
class Binding:
    """One held, pod-bound Lease as the operator follows it."""

    rec: LeaseRecord  # the version last seen (decoded without its history)
    seen_at: float  # monotonic: when `rec`'s version was first seen
    duration_s: int | None = None  # the Task's spec.leaseDurationSeconds, once read
    baseline: Mapping[str, tuple[int, bool]] | None = None  # the Pod's containers when first seen Running
    lost: str = ""  # why its Pod is gone, once a Pod event said so

    @property
    def pod(self) -> Key:
        return (self.rec.namespace, self.rec.holder_pod)


class Act(Enum):
    WAIT = "wait"  # nothing now; look again at `at` (None: only when an event comes)
    READ_TASK = "read-task"  # the Task's lease duration is not known yet
    RENEW = "renew"
    EXPIRE = "expire"


@dataclass(frozen=True)
class Verdict:
    act: Act
    at: float | None = None
    cause: str = ""  # EXPIRE: pod-gone or container-restarted (metrics.EXPIRATIONS's cause)
    message: str = ""


@dataclass
class Bindings:
    """The bound leases and the Pods they are bound to; decides what each needs. Not thread-safe."""

    monotonic: Monotonic
    _bound: dict[Key, Binding] = field(default_factory=dict)
    # Every agent Pod the operator watches (labelled tasklease.dev/agent=true): a lease may
    # be bound to it later.
    _pods: dict[Key, PodState] = field(default_factory=dict)
    _by_pod: dict[Key, set[Key]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self._bound)

    def get(self, key: Key) -> Binding | None:
        return self._bound.get(key)

    def lease(self, key: Key, rec: LeaseRecord | None) -> bool:
        """A Lease version (None: deleted). True while it is held pod-bound."""
        old = self._bound.get(key)
        if rec is None or rec.state != record.HELD or not rec.pod_bound:
            self._drop(key)
            return False
        if old is None or (old.rec.epoch, old.rec.holder, old.rec.pod_bound) != (rec.epoch, rec.holder, rec.pod_bound):
            self._drop(key)
            binding = Binding(rec, self.monotonic())
            self._bound[key] = binding
            self._by_pod.setdefault(binding.pod, set()).add(key)
            self._note_pod(binding)
        elif old.rec.resource_version != rec.resource_version:
            old.rec, old.seen_at = rec, self.monotonic()
        return True

    def pod(self, kind: str, pod: JSON) -> list[Key]:
        """A Pod event: the bound leases whose verdict it may change."""
        meta = pod.get("metadata") or {}
        where = (str(meta.get("namespace", "")), str(meta.get("name", "")))
        keys = sorted(self._by_pod.get(where, ()))
        state = pod_state(pod)
        if kind == "DELETED":
            if (known := self._pods.get(where)) is not None and known.uid == state.uid:
                del self._pods[where]
            for key in keys:
                binding = self._bound[key]
                if binding.rec.pod_bound == state.uid:
                    binding.lost = binding.lost or f"its pod {where[1]} was deleted"
        else:
            self._pods[where] = state
            for key in keys:
                self._note_pod(self._bound[key])
        return keys

    def read_task(self, key: Key, duration_s: int) -> None:
        if (binding := self._bound.get(key)) is not None:
            binding.duration_s = duration_s

    def decide(self, key: Key) -> Verdict:
        binding = self._bound.get(key)
        if binding is None:
            return Verdict(Act.WAIT)
        pod_name = binding.pod[1]
        if binding.lost:
            return Verdict(Act.EXPIRE, cause="pod-gone", message=binding.lost)
        pod = self._pods.get(binding.pod)
        if pod is None:
            return Verdict(Act.WAIT)  # a Pod we cannot see gets no renewals
        if pod.uid != binding.rec.pod_bound:
            return Verdict(Act.EXPIRE, cause="pod-gone",
                           message=f"its pod {pod_name} is gone (a pod of that name with another uid runs)")
        if pod.phase in _GONE_PHASES:
            return Verdict(Act.EXPIRE, cause="pod-gone", message=f"its pod {pod_name} terminated ({pod.phase})")
        restarted = _restarted(binding.baseline, pod)
        if restarted:
            return Verdict(Act.EXPIRE, cause="container-restarted", message=f"in its pod {pod_name}, {restarted}")
        if pod.phase != "Running" or pod.deleting or binding.baseline is None:
            return Verdict(Act.WAIT)  # not (yet, or any more) a running Pod: no renewals
        if binding.duration_s is None:
            return Verdict(Act.READ_TASK)
        due = binding.seen_at + binding.duration_s / RENEWALS_PER_DURATION
        return Verdict(Act.RENEW) if self.monotonic() >= due else Verdict(Act.WAIT, at=due)

    def _note_pod(self, binding: Binding) -> None:
        """The restart counts a binding is judged against: the Pod's, the first time it is seen
        Running as the bound Pod (a restart before that moment goes unnoticed)."""
        pod = self._pods.get(binding.pod)
        if (binding.baseline is None and pod is not None and pod.uid == binding.rec.pod_bound
                and pod.phase == "Running"):
            binding.baseline = dict(pod.containers)

    def _drop(self, key: Key) -> None:
        binding = self._bound.pop(key, None)
        if binding is None:
            return
        keys = self._by_pod.get(binding.pod, set())
        keys.discard(key)
        if not keys:
            self._by_pod.pop(binding.pod, None)


def _restarted(baseline: Mapping[str, tuple[int, bool]] | None, pod: PodState) -> str:
    """What changed in `pod`'s containers since `baseline`: "" when nothing did."""
    for name, (restarts, running) in sorted((baseline or {}).items()):
        now_restarts, now_running = pod.containers.get(name, (restarts, running))
        if now_restarts > restarts:
            return f"container {name} restarted (restartCount {restarts} → {now_restarts})"
        if running and not now_running:
            return f"container {name} stopped"
    return ""


class PodBound:
    """Carries out `Bindings`' verdicts on its own thread (`run`), while `active` (we lead).

    Wired by the controller: `on_lease` beside the reconciler's for every Lease event,
    `on_pod` beside it for every Pod event, and `run` on a thread of its own."""

    def __init__(self, kube: Kube, *, active: threading.Event, monotonic: Monotonic = time.monotonic,
                 component: str = "tasklease-operator") -> None:
        self.kube = kube
        self.protocol = Protocol(kube)
        self.active = active
        self.component = component
        self.bindings = Bindings(monotonic)
        self._deadlines: DeadlineQueue[Key] = DeadlineQueue()
        self._now: set[Key] = set()
        self._announced: dict[Key, int] = {}  # lease → the epoch whose binding we told of
        self._cond = threading.Condition()

    def on_lease(self, kind: str, obj: JSON, rec: LeaseRecord | None) -> None:
        """`rec`: `obj` read (`record.read`; None: unreadable, which the reconciler reports)."""
        meta = obj.get("metadata") or {}
        key = (str(meta.get("namespace", "")), str(meta.get("name", "")))
        with self._cond:
            if self.bindings.lease(key, None if kind == "DELETED" else rec):
                self._wake(key)
            else:
                self._announced.pop(key, None)

    def on_pod(self, kind: str, obj: JSON) -> None:
        with self._cond:
            for key in self.bindings.pod(kind, obj):
                self._wake(key)

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            key = self._take()
            if key is None:
                continue
            try:
                self.step(key)
            except Exception:  # noqa: BLE001 - a bug must not stop the other bound leases
                log.exception("lease %s/%s (pod-bound): failed", *key)
                self._later(key)

    def step(self, key: Key) -> None:
        """Decide for one bound lease and act on it: at most one write."""
        with self._cond:
            verdict = self.bindings.decide(key)
            binding = self.bindings.get(key)
            rec = binding.rec if binding is not None else None
        if verdict.act is Act.WAIT or rec is None:
            if verdict.at is not None:
                with self._cond:
                    self._deadlines.schedule(key, verdict.at)
            return
        if not self.active.is_set():
            self._later(key)  # a standby follows, the leader acts
            return
        try:
            if verdict.act is Act.READ_TASK:
                self._read_task(key, rec)
            elif verdict.act is Act.RENEW:
                self._renew(key, rec)
            else:
                self._expire(rec, verdict)
        except errors.Conflict:
            self._later(key)  # the watch brings the newer version, and with it a new verdict
        except errors.NotFound:
            return  # the Lease is gone: its DELETED event drops the binding
        except errors.TaskleaseError as exc:
            log.warning("lease %s/%s (pod-bound): %s; will retry", rec.namespace, rec.name, exc)
            self._later(key)

    def _read_task(self, key: Key, rec: LeaseRecord) -> None:
        task = self.kube.get_or_none(TASKS, rec.name, namespace=rec.namespace)
        if task is None or task["metadata"]["uid"] != rec.owner_uid:
            return  # the reconciler removes a Lease whose Task is gone
        with self._cond:
            self.bindings.read_task(key, TaskView.of(task).spec.lease_duration_seconds)
            self._wake(key)
            told = self._announced.get(key) == rec.epoch
            self._announced[key] = rec.epoch
        if not told:
            log.info("task %s/%s: attempt %d of %s is bound to pod %s: the operator renews it while the pod runs",
                     rec.namespace, rec.name, rec.epoch, rec.holder, rec.holder_pod)
            events.post(self.kube, task, "Normal", "PodBound",
                        f"attempt {rec.epoch} of {rec.holder}: renewed by the operator while pod "
                        f"{rec.holder_pod} runs and its containers do not restart", component=self.component)

    def _renew(self, key: Key, rec: LeaseRecord) -> None:
        written = self.protocol.keep_alive(rec)
        metrics.POD_BOUND_RENEWALS.labels(rec.namespace, rec.queue).inc()
        log.debug("lease %s/%s: renewed for pod %s", rec.namespace, rec.name, rec.holder_pod)
        with self._cond:
            # Our own write is a new version: the next renewal counts from now (the watch
            # brings the same version and changes nothing).
            self.bindings.lease(key, replace(written, raw={}))
            self._wake(key)

    def _expire(self, rec: LeaseRecord, verdict: Verdict) -> None:
        """Expire attempt `rec.epoch` of its holder, judged on the Lease and the Task as they are now."""
        task = self.kube.get_or_none(TASKS, rec.name, namespace=rec.namespace)
        current = self.protocol.read(rec.namespace, rec.name)
        if (task is None or current is None or current.state != record.HELD or task["metadata"]["uid"] !=
                current.owner_uid or (current.epoch, current.holder) != (rec.epoch, rec.holder)):
            return  # ended meanwhile: nothing of this attempt is left to expire
        view = TaskView.of(task)
        self.protocol.expire(view, current, message=f"lease of {rec.holder} (pod-bound) expired: {verdict.message}")
        metrics.EXPIRATIONS.labels(rec.namespace, view.spec.queue, verdict.cause).inc()
        log.info("task %s/%s: expired attempt %d of %s (%s: %s)", rec.namespace, rec.name, rec.epoch, rec.holder,
                 verdict.cause, verdict.message)

    def _wake(self, key: Key) -> None:
        """Caller holds the lock."""
        self._now.add(key)
        self._cond.notify_all()

    def _later(self, key: Key) -> None:
        with self._cond:
            self._deadlines.schedule(key, self.bindings.monotonic() + _RETRY_S)

    def _take(self) -> Key | None:
        with self._cond:
            now = self.bindings.monotonic()
            self._now.update(self._deadlines.pop_due(now))
            if self._now:
                return self._now.pop()
            nxt = self._deadlines.next_at()
            self._cond.wait(_RETRY_S if nxt is None else min(max(nxt - now, 0.0), _RETRY_S))
            return None

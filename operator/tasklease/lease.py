"""The claim protocol: every transition of a task's Lease, each exactly one conditional write.

The Lease named like its Task is both the lock and the commit record (docs/protocol.md):

    free ──claim──▶ held(A, E) ──renew──▶ held(A, E)
      ▲                 │
      │   release / fail(retryable) / expire / requeue
      └─────────────────┤
                        └─ complete / fail(final) / dead-letter / cancel / deadline ──▶ closed(outcome)

`E` is `spec.leaseTransitions`, the fencing epoch: it grows by one with every claim and
never goes down. Every write carries the resourceVersion its writer read (or is a create
that fails with 409), so when two writers race exactly one wins (I1), and the write that
ends an attempt also carries its outcome, so "holder completes" and "lease expires"
cannot both happen (I4).

The module is split like client-go's resourcelock: `LeaseRecord` is a neutral view
decoded from and encoded to the Lease in one place; the transition functions are pure
(`_claimed`, `_ended`, ...); `Protocol` does the one write per transition.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from tasklease import errors, models
from tasklease.kube import JSON, LEASES, TASKS, Kube

LABEL_MANAGED: Final = "app.kubernetes.io/managed-by"
LABEL_QUEUE: Final = "tasklease.dev/queue"
LABEL_STATE: Final = "tasklease.dev/state"
LABEL_HOLDER_POD: Final = "tasklease.dev/holder-pod"
ANN_OUTCOME: Final = "tasklease.dev/outcome"
ANN_REASON: Final = "tasklease.dev/reason"
ANN_RESULT: Final = "tasklease.dev/result"
ANN_ERROR: Final = "tasklease.dev/error"
ANN_NOT_BEFORE: Final = "tasklease.dev/not-before"
ANN_HISTORY: Final = "tasklease.dev/history"

MANAGED_SELECTOR: Final = f"{LABEL_MANAGED}=tasklease"

FREE, HELD, CLOSED = "free", "held", "closed"


def now_utc() -> datetime:
    return datetime.now(UTC)


Clock = Callable[[], datetime]


# -- the neutral record ---------------------------------------------------------------


@dataclass(frozen=True)
class LeaseRecord:
    """What a Lease says, free of the Lease's wire format."""

    name: str
    namespace: str
    queue: str
    owner_uid: str
    holder: str = ""
    epoch: int = 0
    duration_s: int = 30
    acquired_at: datetime | None = None
    renewed_at: datetime | None = None
    outcome: str = ""  # Succeeded | Failed | Cancelled when closed
    reason: str = ""
    result: str = ""
    error: str = ""
    not_before: datetime | None = None
    history: tuple[models.Attempt, ...] = ()
    resource_version: str = ""
    raw: JSON = field(default_factory=dict, compare=False, repr=False)

    @property
    def state(self) -> str:
        if self.outcome:
            return CLOSED
        return HELD if self.holder else FREE

    @property
    def holder_pod(self) -> str:
        return holder_pod(self.holder)


def holder_pod(holder: str) -> str:
    """`<pod>/<instance>` → `<pod>`."""
    return holder.rsplit("/", 1)[0] if "/" in holder else holder


def holder_instance(holder: str) -> str:
    """`<pod>/<instance>` → `<instance>`."""
    return holder.rsplit("/", 1)[1] if "/" in holder else ""


def decode(lease: JSON) -> LeaseRecord:
    meta = lease.get("metadata", {})
    spec = lease.get("spec", {})
    ann = meta.get("annotations") or {}
    labels = meta.get("labels") or {}
    owners = [o for o in meta.get("ownerReferences") or [] if o.get("kind") == models.KIND]
    history = tuple(models.Attempt.model_validate(a) for a in json.loads(ann.get(ANN_HISTORY) or "[]"))
    return LeaseRecord(
        name=meta["name"], namespace=meta["namespace"], queue=labels.get(LABEL_QUEUE, ""),
        owner_uid=owners[0]["uid"] if owners else "",
        holder=spec.get("holderIdentity") or "", epoch=int(spec.get("leaseTransitions") or 0),
        duration_s=int(spec.get("leaseDurationSeconds") or 30),
        acquired_at=parse_time(spec.get("acquireTime")), renewed_at=parse_time(spec.get("renewTime")),
        outcome=ann.get(ANN_OUTCOME, ""), reason=ann.get(ANN_REASON, ""), result=ann.get(ANN_RESULT, ""),
        error=ann.get(ANN_ERROR, ""), not_before=parse_time(ann.get(ANN_NOT_BEFORE)),
        history=history, resource_version=meta.get("resourceVersion", ""), raw=lease,
    )


def encode(rec: LeaseRecord) -> JSON:
    """The whole Lease for a PUT (or POST): carries rec.resource_version as the precondition."""
    meta: JSON = {
        "name": rec.name, "namespace": rec.namespace,
        "labels": {LABEL_MANAGED: "tasklease", LABEL_QUEUE: rec.queue, LABEL_STATE: rec.state},
        "annotations": {},
        "ownerReferences": [{
            "apiVersion": f"{models.GROUP}/{models.VERSION}", "kind": models.KIND, "name": rec.name,
            "uid": rec.owner_uid, "controller": True, "blockOwnerDeletion": False,
        }],
    }
    if rec.holder:
        meta["labels"][LABEL_HOLDER_POD] = label_value(rec.holder_pod)
    if rec.resource_version:
        meta["resourceVersion"] = rec.resource_version
    ann = meta["annotations"]
    for key, value in ((ANN_OUTCOME, rec.outcome), (ANN_REASON, rec.reason), (ANN_RESULT, rec.result),
                       (ANN_ERROR, rec.error), (ANN_NOT_BEFORE, format_time(rec.not_before))):
        if value:
            ann[key] = value
    if rec.history:
        ann[ANN_HISTORY] = json.dumps([a.model_dump(mode="json", by_alias=True, exclude_defaults=True)
                                       for a in rec.history], separators=(",", ":"))
    spec: JSON = {"leaseDurationSeconds": rec.duration_s, "leaseTransitions": rec.epoch,
                  "holderIdentity": rec.holder or None,
                  "acquireTime": format_time(rec.acquired_at), "renewTime": format_time(rec.renewed_at)}
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}


# -- pure transitions -------------------------------------------------------------------


@dataclass(frozen=True)
class TaskView:
    """The parts of a Task the protocol decides with."""

    name: str
    namespace: str
    uid: str
    spec: models.TaskSpec
    created: str
    status_attempt: int = 0
    status_phase: str = ""

    @classmethod
    def of(cls, task: JSON) -> TaskView:
        meta = task["metadata"]
        status = task.get("status") or {}
        return cls(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"],
                   spec=models.TaskSpec.model_validate(task.get("spec", {})),
                   created=meta.get("creationTimestamp", ""),
                   status_attempt=int(status.get("attempt") or 0), status_phase=str(status.get("phase") or ""))


def fresh_record(task: TaskView) -> LeaseRecord:
    return LeaseRecord(name=task.name, namespace=task.namespace, queue=task.spec.queue, owner_uid=task.uid,
                       duration_s=task.spec.lease_duration_seconds)


def why_not_claimable(task: TaskView, rec: LeaseRecord | None, now: datetime) -> str | None:
    """None when `task` may be claimed now; otherwise the reason, for logs and errors."""
    if task.status_phase in models.TERMINAL_PHASES:
        return f"finished ({task.status_phase})"  # even if its Lease was deleted by hand
    if task.spec.cancel:
        return "cancelled"
    if task.spec.deadline is not None and now >= task.spec.deadline:
        return "past its deadline"
    if rec is None:
        return None
    if rec.owner_uid != task.uid:
        return "its Lease belongs to an older task of the same name"
    if rec.state == CLOSED:
        return f"closed ({rec.outcome})"
    if rec.state == HELD:
        return f"held by {rec.holder}"
    if rec.not_before is not None and now < rec.not_before:
        return f"backing off until {format_time(rec.not_before)}"
    if max(rec.epoch, task.status_attempt) >= task.spec.max_attempts:
        return "attempts spent"
    return None


def _claimed(task: TaskView, rec: LeaseRecord | None, holder: str, now: datetime) -> LeaseRecord:
    base = rec or fresh_record(task)
    # The status projection remembers the epoch even if the Lease was deleted by hand.
    epoch = max(base.epoch, task.status_attempt) + 1
    entry = models.Attempt(attempt=epoch, holder=holder, claimed_at=now)
    return replace(base, holder=holder, epoch=epoch, duration_s=task.spec.lease_duration_seconds,
                   acquired_at=now, renewed_at=now, not_before=None,
                   history=(*base.history, entry)[-models.MAX_HISTORY:])


def _ended(rec: LeaseRecord, *, outcome: str, now: datetime, message: str = "", close: str = "",
           reason: str = "", result: str = "", not_before: datetime | None = None) -> LeaseRecord:
    """End the current attempt (if any) with `outcome`; `close` makes the Lease terminal."""
    history = rec.history
    if rec.holder and history and history[-1].attempt == rec.epoch and not history[-1].outcome:
        last = history[-1].model_copy(
            update={"ended_at": now, "outcome": outcome, "message": message[:models.MAX_ERROR_CHARS]})
        history = (*history[:-1], last)
    # lastError tells why a task is not done yet; a success has nothing left to explain.
    error = "" if close == models.Phase.SUCCEEDED.value else (
        message[:models.MAX_ERROR_CHARS] if outcome in ("Failed", "Expired") else rec.error)
    return replace(rec, holder="", renewed_at=now, outcome=close, reason=reason, result=result,
                   error=error, not_before=not_before, history=history)


def _requeued(rec: LeaseRecord, spec: models.TaskSpec, *, outcome: str, message: str, now: datetime,
              backoff: bool) -> LeaseRecord:
    """Free for the next attempt, or dead-lettered when the attempts are spent (I3)."""
    if rec.epoch >= spec.max_attempts:
        return _ended(rec, outcome=outcome, now=now, message=message, close=models.Phase.FAILED.value,
                      reason="DeadLettered")
    not_before = now + timedelta(seconds=spec.backoff.delay_after(rec.epoch)) if backoff else None
    return _ended(rec, outcome=outcome, now=now, message=message, not_before=not_before)


# -- the writes -----------------------------------------------------------------------


@dataclass(frozen=True)
class Held:
    """Proof of a claim: who holds which task at which epoch, as of `resource_version`."""

    namespace: str
    name: str
    holder: str
    epoch: int
    spec: models.TaskSpec
    uid: str
    record: LeaseRecord  # the Lease as our last write left it: the next write's precondition

    @property
    def duration_s(self) -> int:
        return self.spec.lease_duration_seconds


class Protocol:
    """The Lease transitions. Every method makes at most one write per attempt of it."""

    def __init__(self, kube: Kube, *, clock: Clock = now_utc) -> None:
        self.kube = kube
        self.clock = clock

    # reads

    def read(self, namespace: str, name: str, *, timeout: float = 30) -> LeaseRecord | None:
        lease = self.kube.get_or_none(LEASES, name, namespace=namespace, timeout=timeout)
        return decode(lease) if lease else None

    def end(self, namespace: str, name: str, *, holder: str, epoch: int, outcome: str,
            write: Callable[[Held], Held], result: str = "") -> None:
        """End attempt `epoch` of `holder` statelessly (the CLI): adopt it, then `write`. A
        repeat of an ending whose first answer was lost finds it applied and succeeds."""
        try:
            held = self.adopt(namespace, name, holder=holder, epoch=epoch)
        except errors.LostLease:
            rec = self.read(namespace, name)
            if rec is not None and _ended_as(rec, epoch=epoch, holder=holder, outcome=outcome, result=result):
                return
            raise
        write(held)

    # agent side

    def claim(self, task: TaskView, rec: LeaseRecord | None, holder: str) -> Held:
        """free → held(holder, E+1). Conflict when another agent won the race."""
        now = self.clock()
        reason = why_not_claimable(task, rec, now)
        if reason is not None:
            raise errors.NotClaimable(f"task {task.namespace}/{task.name} is not claimable: {reason}")
        written = self._write(_claimed(task, rec, holder, now), create=rec is None)
        return Held(namespace=task.namespace, name=task.name, holder=holder, epoch=written.epoch,
                    spec=task.spec, uid=task.uid, record=written)

    def adopt(self, namespace: str, name: str, *, holder: str, epoch: int) -> Held:
        """Rebuild a Held from the API server (the CLI is stateless): it must still be ours."""
        return self.held_from(self._ours(namespace, name, holder=holder, epoch=epoch))

    def held_from(self, rec: LeaseRecord) -> Held:
        """The Held of whoever holds `rec` now, with its Task's spec (one GET)."""
        task = self.kube.get_or_none(TASKS, rec.name, namespace=rec.namespace)
        if task is None or task["metadata"]["uid"] != rec.owner_uid:
            raise errors.LostLease(f"task {rec.namespace}/{rec.name} no longer exists")
        view = TaskView.of(task)
        return Held(namespace=rec.namespace, name=rec.name, holder=rec.holder, epoch=rec.epoch,
                    spec=view.spec, uid=view.uid, record=rec)

    def renew(self, held: Held, *, timeout: float = 30) -> Held:
        """held(A, E) → held(A, E) with a new renewTime. LostLease when it is not ours any more.
        `timeout` bounds the request: a renewal that arrives after the renew deadline is useless."""
        def renewed(rec: LeaseRecord) -> LeaseRecord:
            return replace(rec, renewed_at=self.clock())
        return self._as_holder(held, renewed, timeout=timeout)

    def complete(self, held: Held, result: str) -> Held:
        """held(A, E) → closed(Succeeded, result): the result is accepted only with ownership."""
        if len(result) > models.MAX_RESULT_BYTES:
            raise errors.Invalid(f"result is {len(result)} characters; the limit is {models.MAX_RESULT_BYTES}")
        return self._as_holder(held, lambda rec: _ended(
            rec, outcome="Succeeded", now=self.clock(), close=models.Phase.SUCCEEDED.value, reason="Completed",
            result=result))

    def fail(self, held: Held, message: str, *, retryable: bool = True) -> Held:
        """held(A, E) → free after backoff, or closed(Failed) when final or attempts are spent."""
        def failed(rec: LeaseRecord) -> LeaseRecord:
            if retryable:
                return _requeued(rec, held.spec, outcome="Failed", message=message, now=self.clock(), backoff=True)
            return _ended(rec, outcome="Failed", now=self.clock(), message=message,
                          close=models.Phase.FAILED.value, reason="Failed")
        return self._as_holder(held, failed)

    def release(self, held: Held, message: str = "released by its holder") -> Held:
        """held(A, E) → free at once (no backoff): the holder gives the task back."""
        return self._as_holder(held, lambda rec: _requeued(
            rec, held.spec, outcome="Released", message=message, now=self.clock(), backoff=False))

    # operator side (and `tasklease cancel/requeue`): conditional on what the caller observed

    def expire(self, task: TaskView, rec: LeaseRecord) -> LeaseRecord:
        """held(A, E) → free after backoff (or dead-lettered). Conflict if the holder renewed meanwhile."""
        if rec.state != HELD:
            raise errors.Invalid(f"lease {rec.namespace}/{rec.name} is {rec.state}, not held")
        return self._write(_requeued(rec, task.spec, outcome="Expired", message=f"lease of {rec.holder} expired",
                                     now=self.clock(), backoff=True))

    def requeue(self, task: TaskView, rec: LeaseRecord | None, message: str = "requeued") -> LeaseRecord:
        """held/free → free now, without backoff. Refused for closed leases (I4)."""
        if rec is None:
            raise errors.Invalid(f"task {task.namespace}/{task.name} has never been claimed: nothing to requeue")
        if rec.state == CLOSED:
            raise errors.Invalid(f"task {task.namespace}/{task.name} is finished ({rec.outcome}); "
                                 "a finished task never runs again")
        if rec.epoch >= task.spec.max_attempts:
            raise errors.Invalid(f"task {task.namespace}/{task.name} has used all {task.spec.max_attempts} attempts")
        return self._write(_ended(rec, outcome="Requeued", now=self.clock(), message=message))

    def close(self, task: TaskView, rec: LeaseRecord | None, *, phase: models.Phase, reason: str,
              message: str) -> LeaseRecord:
        """Anything not closed → closed(phase): cancel, deadline. Creates the Lease if there is none."""
        if rec is not None and rec.state == CLOSED:
            raise errors.Invalid(f"task {task.namespace}/{task.name} is already {rec.outcome}")
        base = rec or fresh_record(task)
        return self._write(_ended(base, outcome=reason, now=self.clock(), message=message, close=phase.value,
                                  reason=reason), create=rec is None)

    # internals

    def _write(self, rec: LeaseRecord, *, create: bool = False, timeout: float = 30) -> LeaseRecord:
        body = encode(rec)
        if create:
            body["metadata"].pop("resourceVersion", None)
            return decode(self.kube.create(LEASES, body, namespace=rec.namespace, timeout=timeout))
        return decode(self.kube.replace(LEASES, body, timeout=timeout))

    def _ours(self, namespace: str, name: str, *, holder: str, epoch: int) -> LeaseRecord:
        rec = self.read(namespace, name)
        if rec is None:
            raise errors.LostLease(f"task {namespace}/{name}: its lease is gone")
        return _check_holder(rec, namespace=namespace, name=name, holder=holder, epoch=epoch)

    def _as_holder(self, held: Held, change: Callable[[LeaseRecord], LeaseRecord], *,
                   timeout: float = 30) -> Held:
        """Apply `change` to the Lease as we last wrote it: one PUT. A 409 is re-read: an
        unrelated write (a label added by hand) leaves ownership intact and is retried; our
        own earlier write whose answer was lost (a retried completion) counts as done;
        anything else is a lost lease."""
        rec = held.record
        for _ in range(5):
            intended = change(rec)
            try:
                return replace(held, record=self._write(intended, timeout=timeout))
            except errors.Conflict:
                current = self.read(held.namespace, held.name, timeout=timeout)
                if current is not None and _already_applied(current, intended, held):
                    return replace(held, record=current)
                rec = _still_ours(current, held)
            except errors.NotFound:
                raise errors.LostLease(f"task {held.namespace}/{held.name}: its lease is gone") from None
        raise errors.LostLease(f"task {held.namespace}/{held.name}: the lease keeps changing under its holder")


def _check_holder(rec: LeaseRecord, *, namespace: str, name: str, holder: str, epoch: int) -> LeaseRecord:
    if rec.state != HELD or rec.holder != holder or rec.epoch != epoch:
        now = f"held by {rec.holder} at attempt {rec.epoch}" if rec.state == HELD else rec.state
        raise errors.LostLease(f"task {namespace}/{name}: attempt {epoch} of {holder} is over (now {now})")
    return rec


def _still_ours(current: LeaseRecord | None, held: Held) -> LeaseRecord:
    if current is None or current.owner_uid != held.uid:
        raise errors.LostLease(f"task {held.namespace}/{held.name}: its lease is gone")
    return _check_holder(current, namespace=held.namespace, name=held.name, holder=held.holder, epoch=held.epoch)


def _already_applied(current: LeaseRecord, intended: LeaseRecord, held: Held) -> bool:
    """True when `current` is the end of attempt `held.epoch` that `intended` describes."""
    return (intended.state != HELD and current.owner_uid == held.uid and current.state == intended.state
            and current.outcome == intended.outcome and bool(intended.history)
            and _ended_as(current, epoch=held.epoch, holder=held.holder, outcome=intended.history[-1].outcome,
                          result=intended.result))


def _ended_as(rec: LeaseRecord, *, epoch: int, holder: str, outcome: str, result: str) -> bool:
    """Attempt `epoch` of `holder` is the last one, ended with `outcome`, leaving `result`."""
    if rec.epoch != epoch or not rec.history:
        return False
    last = rec.history[-1]
    return (last.attempt, last.holder, last.outcome, rec.result) == (epoch, holder, outcome, result)


def pick(candidates: list[tuple[TaskView, LeaseRecord | None]], *, best_of: int,
         rng: random.Random) -> list[tuple[TaskView, LeaseRecord | None]]:
    """The few to try now: the `best_of` highest-priority (then oldest) candidates, shuffled,
    so that a fleet woken by the same event does not race for the same task. The rest wait
    for the next look, when the winners' Leases have arrived through the watch."""
    ranked = sorted(candidates, key=lambda c: (-c[0].spec.priority, c[0].created, c[0].name))
    head = ranked[:best_of]
    rng.shuffle(head)
    return head


def parse_time(value: Any) -> datetime | None:
    if not value:
        return None
    return datetime.fromisoformat(str(value).replace("Z", "+00:00"))


def format_time(value: datetime | None) -> str | None:
    if value is None:
        return None
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def label_value(value: str) -> str:
    """Pod names longer than a label value allows are cut; the holder itself stays exact."""
    return value[:63].rstrip("-_.")


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

Split like client-go's resourcelock: `record` decodes and encodes, `rules` computes the
next record (pure), and `Protocol` here does the one write per transition.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime

from tasklease.api import errors, models
from tasklease.api.timestamps import Clock, format_time
from tasklease.kube import LEASES, TASKS, Kube
from tasklease.protocol.record import (
    CLOSED,
    FREE,
    HELD,
    MAX_EPOCH,
    LeaseRecord,
    decode,
    encode,
    encode_patch,
    encode_replacement,
    written,
)
from tasklease.protocol.rules import (
    TaskView,
    attempts_used,
    claimed,
    ended,
    fresh_record,
    requeued,
    retried,
    undone,
    why_not_claimable,
    why_not_retryable,
)


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

    def __init__(self, kube: Kube, *, clock: Clock | None = None) -> None:
        """`clock`: the API server's time (`Kube.now`) unless a test pins one: claimability is
        judged against the times on the Task, which the API server's clock is the one to read."""
        self.kube = kube
        self.clock = clock or kube.now

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
        written = self._write(claimed(task, rec, holder, now), create=rec is None)
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
        return self._as_holder(held, lambda rec: ended(
            rec, outcome="Succeeded", now=self.clock(), close=models.Phase.SUCCEEDED.value, reason="Completed",
            result=result))

    def fail(self, held: Held, message: str, *, retryable: bool = True) -> Held:
        """held(A, E) → free after backoff, or closed(Failed) when final or attempts are spent."""
        def failed(rec: LeaseRecord) -> LeaseRecord:
            if retryable:
                return requeued(rec, held.spec, outcome="Failed", message=message, now=self.clock(), backoff=True)
            return ended(rec, outcome="Failed", now=self.clock(), message=message,
                          close=models.Phase.FAILED.value, reason="Failed")
        return self._as_holder(held, failed)

    def bind_to_pod(self, held: Held, pod_uid: str) -> Held:
        """held(A, E) → held(A, E) bound to the holder's Pod: the operator renews it while that
        Pod runs and its containers do not restart (docs/pod-bound.md)."""
        if not pod_uid:
            raise errors.Invalid("a pod-bound lease needs the holder's Pod uid (POD_UID from the downward API, "
                                 "or a token bound to the Pod)")
        return self._as_holder(held, lambda rec: replace(rec, pod_bound=pod_uid, renewed_at=self.clock()))

    def release(self, held: Held, message: str = "released by its holder") -> Held:
        """held(A, E) → free at once (no backoff): the holder gives the task back."""
        return self._as_holder(held, lambda rec: requeued(
            rec, held.spec, outcome="Released", message=message, now=self.clock(), backoff=False))

    # operator side (and `tasklease cancel/requeue`): conditional on what the caller observed

    def expire(self, task: TaskView, rec: LeaseRecord, message: str = "") -> LeaseRecord:
        """held(A, E) → free after backoff (or dead-lettered). Conflict if the holder renewed meanwhile."""
        if rec.state != HELD:
            raise errors.Invalid(f"lease {rec.namespace}/{rec.name} is {rec.state}, not held")
        return self._write(requeued(rec, task.spec, outcome="Expired",
                                     message=message or f"lease of {rec.holder} expired", now=self.clock(),
                                     backoff=True))

    def keep_alive(self, rec: LeaseRecord) -> LeaseRecord:
        """The operator renews a pod-bound lease: renewTime only, conditional on the version it
        saw (409 if the holder wrote meanwhile, 404 if the Lease is gone)."""
        if rec.state != HELD or not rec.pod_bound:
            raise errors.Invalid(f"lease {rec.namespace}/{rec.name} is not held pod-bound")
        patch = {"metadata": {"resourceVersion": rec.resource_version},
                 "spec": {"renewTime": format_time(self.clock())}}
        return decode(self.kube.merge_patch(LEASES, rec.name, patch, namespace=rec.namespace))

    def undo(self, rec: LeaseRecord, why: str, *, not_before: datetime | None) -> LeaseRecord:
        """held(A, E) → free, not counted (`rules.undone`): the operator takes back a claim made
        while the task was not claimable by the server's clock. Conflict if the Lease moved."""
        if rec.state != HELD:
            raise errors.Invalid(f"lease {rec.namespace}/{rec.name} is {rec.state}, not held")
        return self._write(undone(rec, now=self.clock(), message=f"claim by {rec.holder} undone: {why}",
                                  not_before=not_before))

    def reschedule(self, rec: LeaseRecord, not_before: datetime) -> LeaseRecord:
        """free(nb) → free(not_before): the operator puts right a backoff end that a failing
        holder wrote with its own clock. Conflict if the Lease moved (a claim came first)."""
        if rec.state != FREE:
            raise errors.Invalid(f"lease {rec.namespace}/{rec.name} is {rec.state}, not free")
        return self._write(replace(rec, not_before=not_before))

    def time_out(self, task: TaskView, rec: LeaseRecord, message: str) -> LeaseRecord:
        """held(A, E) → free after backoff (or dead-lettered), attempt E ended AttemptTimedOut: it ran
        past its attempt timeout. Conflict if the Lease moved meanwhile (the holder ended it first)."""
        if rec.state != HELD:
            raise errors.Invalid(f"lease {rec.namespace}/{rec.name} is {rec.state}, not held")
        return self._write(requeued(rec, task.spec, outcome=models.ATTEMPT_TIMED_OUT, message=message,
                                     now=self.clock(), backoff=True))

    def requeue(self, task: TaskView, rec: LeaseRecord | None, message: str = "requeued") -> LeaseRecord:
        """held/free → free now, without backoff. Refused for closed leases (I4)."""
        if rec is None:
            raise errors.Invalid(f"task {task.namespace}/{task.name} has never been claimed: nothing to requeue")
        if rec.state == CLOSED:
            raise errors.Invalid(f"task {task.namespace}/{task.name} is finished ({rec.outcome}); "
                                 "a finished task never runs again")
        if attempts_used(task, rec) >= task.spec.max_attempts:
            raise errors.Invalid(f"task {task.namespace}/{task.name} has used all {task.spec.max_attempts} attempts")
        return self._write(ended(rec, outcome="Requeued", now=self.clock(), message=message))

    def retry(self, task: TaskView, rec: LeaseRecord | None) -> LeaseRecord:
        """closed(Failed) → free with a fresh budget of maxAttempts claims (redrive). The only
        way out of a closed Lease, and only for a Failed one; the epoch keeps growing."""
        reason = why_not_retryable(task, rec, self.clock())
        if reason is not None or rec is None:
            raise errors.Invalid(f"task {task.namespace}/{task.name} cannot be retried: {reason}")
        return self._write(retried(rec, self.clock()))

    def close(self, task: TaskView, rec: LeaseRecord | None, *, phase: models.Phase, reason: str,
              message: str) -> LeaseRecord:
        """Anything not closed → closed(phase): cancel, deadline, dead letter. Creates the Lease if
        there is none, at the epoch the Task's status remembers (`rules.fresh_record`)."""
        if rec is not None and rec.state == CLOSED:
            raise errors.Invalid(f"task {task.namespace}/{task.name} is already {rec.outcome}")
        base = rec or fresh_record(task)
        return self._write(ended(base, outcome=reason, now=self.clock(), message=message, close=phase.value,
                                  reason=reason), create=rec is None)

    def free(self, task: TaskView, epoch: int) -> LeaseRecord | None:
        """No Lease → free at `epoch`, owned by the Task. None when there is nothing to do: the
        Task is gone or being deleted (checked live), or a Lease of its own came first (a claim:
        its event follows). A Lease of another task in the way is removed first."""
        live = self.kube.get_or_none(TASKS, task.name, namespace=task.namespace)
        if live is None or live["metadata"]["uid"] != task.uid or live["metadata"].get("deletionTimestamp"):
            return None
        for _ in range(2):
            try:
                return self._write(replace(fresh_record(task), epoch=min(epoch, MAX_EPOCH)), create=True)
            except errors.Conflict:
                current = self.read(task.namespace, task.name)
            if current is not None and current.owner_uid == task.uid:
                return None
            if current is not None:
                self.remove_orphan(current)
        return None

    def remove_orphan(self, rec: LeaseRecord) -> bool:
        """Delete a Lease whose Task is gone, or belongs to an older Task of the same name. The
        garbage collector removes most; this covers a Lease that outlived it. The Task is
        checked live (a cache may not have seen it yet) and the delete is conditional on the
        Lease as read. True when this call deleted it."""
        live = self.kube.get_or_none(TASKS, rec.name, namespace=rec.namespace)
        if live is not None and live["metadata"]["uid"] == rec.owner_uid:
            return False
        try:
            self.kube.delete(LEASES, rec.name, namespace=rec.namespace,
                             preconditions={"uid": rec.raw["metadata"]["uid"], "resourceVersion": rec.resource_version})
        except errors.NotFound:
            return False
        return True

    # internals

    def repair(self, task: TaskView, rec: LeaseRecord) -> LeaseRecord:
        """Write `rec` back, labelled again from its Task: puts back the labels a hand edit
        stripped, so that the watches (the operator's and the agents', by label) see it again;
        and leaves out what `record.decode` could not read (its `malformed`)."""
        return self._write(replace(rec, queue=task.spec.queue))

    def _write(self, rec: LeaseRecord, *, create: bool = False, whole: bool = False,
               timeout: float = 30) -> LeaseRecord:
        """Only a claim, or the operator for a task without a Lease (`close`, `free`), creates. A holder's
        write (`whole`: `rec` was made from the Lease as last read, `rec.raw`) is a PUT of
        the whole Lease, conditional on its resourceVersion and uid (409 if it moved or is
        gone); every other write, made from a watcher's picture without the whole Lease,
        is a conditional merge PATCH (404 if the Lease is gone)."""
        if create:
            body = encode(rec)
            body["metadata"].pop("resourceVersion", None)
            return written(rec, body, self.kube.create(LEASES, body, namespace=rec.namespace, timeout=timeout))
        if whole:
            body = encode_replacement(rec)
            return written(rec, body, self.kube.replace(LEASES, body, timeout=timeout))
        return decode(self.kube.merge_patch(LEASES, rec.name, encode_patch(rec), namespace=rec.namespace,
                                            timeout=timeout))

    def _ours(self, namespace: str, name: str, *, holder: str, epoch: int) -> LeaseRecord:
        rec = self.read(namespace, name)
        if rec is None:
            task = self.kube.get_or_none(TASKS, name, namespace=namespace)
            if task is None:
                raise errors.NotFound(f"task {namespace}/{name} does not exist")
            if not (task.get("status") or {}).get("attempt"):  # no attempt projected: most likely none made
                raise errors.LostLease(f"task {namespace}/{name} has no lease: never claimed, or its lease was deleted")
            raise errors.LostLease(f"task {namespace}/{name}: its lease is gone")
        return _check_holder(rec, namespace=namespace, name=name, holder=holder, epoch=epoch)

    def _as_holder(self, held: Held, change: Callable[[LeaseRecord], LeaseRecord], *,
                   timeout: float = 30) -> Held:
        """Apply `change` to the Lease as we last wrote it: one conditional PUT. A 409 is re-read: an
        unrelated write (a label added by hand) leaves ownership intact and is retried; our
        own earlier write whose answer was lost (a retried completion) counts as done;
        anything else is a lost lease."""
        rec = held.record
        for _ in range(5):
            intended = change(rec)
            try:
                return replace(held, record=self._write(intended, whole=True, timeout=timeout))
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


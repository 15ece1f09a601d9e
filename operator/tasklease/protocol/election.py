"""The operator's election Lease: the writes of leader election, as `LeaseRecord`s.

Like client-go's `LeaseLock`: this file only reads and conditionally writes the record;
the election algorithm (observed time, renew deadline) lives in `tasklease.operator.leader`.
The record has no owner, so it carries none of the task labels and no task watch sees it.
"""

from __future__ import annotations

from dataclasses import replace

from tasklease.api import errors
from tasklease.api.timestamps import Clock, now_utc
from tasklease.kube import LEASES, Kube
from tasklease.protocol.record import LeaseRecord, decode, encode, encode_patch


class ElectionLock:
    def __init__(self, kube: Kube, *, namespace: str, name: str, clock: Clock = now_utc) -> None:
        self.kube = kube
        self.namespace = namespace
        self.name = name
        self.clock = clock

    def read(self, *, timeout: float = 30) -> LeaseRecord | None:
        lease = self.kube.get_or_none(LEASES, self.name, namespace=self.namespace, timeout=timeout)
        return decode(lease) if lease else None

    def hold(self, current: LeaseRecord | None, identity: str, *, duration_s: float,
             timeout: float = 30) -> LeaseRecord:
        """Take or renew the lock for `identity`: a create, or a PATCH conditional on `current`.
        Conflict when someone else wrote first. A new holder counts one more transition."""
        now = self.clock()
        if current is None:
            rec = LeaseRecord(name=self.name, namespace=self.namespace, queue="", owner_uid="", holder=identity,
                              duration_s=int(duration_s), acquired_at=now, renewed_at=now)
            return decode(self.kube.create(LEASES, encode(rec), namespace=self.namespace, timeout=timeout))
        taking_over = current.holder != identity
        rec = replace(current, holder=identity, duration_s=int(duration_s), renewed_at=now,
                      acquired_at=now if taking_over else current.acquired_at,
                      epoch=current.epoch + (1 if taking_over else 0))
        return decode(self.kube.merge_patch(LEASES, self.name, encode_patch(rec), namespace=self.namespace,
                                            timeout=timeout))

    def release(self, identity: str) -> None:
        """Hand over at once (a clean shutdown) if we still hold it; any error is only logged by the caller."""
        current = self.read()
        if current is None or current.holder != identity:
            return
        try:
            self.kube.merge_patch(LEASES, self.name, encode_patch(replace(current, holder="")),
                                  namespace=self.namespace)
        except (errors.Conflict, errors.NotFound):
            pass  # someone else wrote meanwhile: it is not ours to release any more

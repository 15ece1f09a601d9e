"""What the operator keeps of a Task and of a Lease between events: a few fields and deflated JSON.

Every Task and every Lease costs memory for as long as it exists, at every queue depth.
Nested dicts are the largest form of a projected Task, compact JSON smaller, and deflated
against a dictionary of what every Task has in common (keys, defaults, and a finished
task's history, the most common kind once a queue has drained) smallest; the
same holds for a Lease decoded into a `LeaseRecord` (datetimes, pydantic attempts). Both
are inflated only when their task is reconciled (`make bench` and `python -m
tasklease_dev.opmem` measure the operator's memory at depth). The dictionaries live in this
process only: what they contain changes how small an object gets, never what comes back.

An object arrives warm, as read, and is deflated (`cool`) only when the store has many
warmer ones (`Warm`): a task at work changes several times in a second, and each of its
events and reconciles would otherwise deflate or inflate it again.
"""

from __future__ import annotations

import json
import sys
import zlib
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Generic, Protocol, TypeVar

from tasklease.api import models
from tasklease.kube import JSON
from tasklease.operator import projection
from tasklease.protocol import LeaseRecord, labels, record

# What a decision or a status write needs of a Task's metadata; the rest (managedFields,
# annotations) stays with the API server.
KEPT_METADATA = ("name", "namespace", "uid", "resourceVersion", "generation", "creationTimestamp")
# What `record.decode` reads of a Lease's metadata, and the uid (an orphan's removal is conditional on it).
KEPT_LEASE_METADATA = ("name", "namespace", "uid", "resourceVersion", "labels", "annotations", "ownerReferences")
# A raw deflate stream (no header or checksum for data that never leaves memory), with a
# window and a hash table sized for a dictionary and an object of a few KiB: at zlib's
# defaults each object would allocate and clear about 256 KiB of state, which costs several
# times what deflating it does (the window still slides over a larger object).
_WBITS = -13
_MEM_LEVEL = 6


class _Packer:
    """Compact JSON with its keys sorted, deflated against `common`: objects shaped as most
    are (their keys sorted too, so that whole runs of an object match), the likeliest last."""

    def __init__(self, *common: JSON) -> None:
        self._common = b"".join(_compact(c) for c in common)

    def pack(self, obj: JSON) -> bytes:
        deflate = zlib.compressobj(9, zlib.DEFLATED, _WBITS, _MEM_LEVEL, zdict=self._common)
        return deflate.compress(_compact(obj)) + deflate.flush()

    def unpack(self, packed: bytes) -> JSON:
        inflate = zlib.decompressobj(_WBITS, zdict=self._common)
        obj: JSON = json.loads(inflate.decompress(packed) + inflate.flush())
        return obj


def _compact(obj: JSON) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


_AT = datetime(2000, 1, 1, tzinfo=UTC)


def _common_task() -> tuple[JSON, JSON]:
    """Two made-up Tasks with every key and default a real one has: one waiting, and one
    finished as the projection writes it (held once, closed Succeeded)."""
    waiting = {"apiVersion": f"{models.GROUP}/{models.VERSION}", "kind": models.KIND,
               "metadata": {**dict.fromkeys(KEPT_METADATA, ""), "generation": 1},
               "spec": models.TaskSpec(queue="q").model_dump(mode="json", by_alias=True, exclude={"payload"}),
               "status": {**models.TaskStatus().model_dump(mode="json", by_alias=True, exclude_none=True),
                          "reason": "Waiting"}}
    closed = record.decode(_common_lease()[1])
    done = projection.project({**waiting, "metadata": {"uid": closed.owner_uid, "generation": 1}}, closed,
                              old=models.TaskStatus(), now=_AT)
    return waiting, {**waiting, "status": done.model_dump(mode="json", by_alias=True, exclude_none=True)}


def _common_lease() -> tuple[JSON, JSON]:
    """Two made-up Leases of a task: held by its first attempt, and closed Succeeded."""
    held = LeaseRecord(name="t", namespace="n", queue="q", owner_uid="u", holder="p/i", epoch=1, acquired_at=_AT,
                       renewed_at=_AT, resource_version="1",
                       history=(models.Attempt(attempt=1, holder="p/i", claimed_at=_AT),))
    closed = replace(held, holder="", outcome="Succeeded", reason="Completed", result="ok",
                     history=(models.Attempt(attempt=1, holder="p/i", claimed_at=_AT, ended_at=_AT,
                                             outcome="Succeeded"),))
    leases = record.encode(held), record.encode(closed)
    for lease in leases:
        lease["metadata"]["uid"] = "u"
    return leases


_TASKS = _Packer(*_common_task())
_LEASES = _Packer(*_common_lease())


@dataclass(slots=True)
class SlimTask:
    """One Task as the reconciler keeps it: the fields read without reconciling it (they
    feed the metrics and order its versions), and the rest, warm or deflated."""

    queue: str
    created: str  # metadata.creationTimestamp
    version: int  # metadata.resourceVersion (`version`)
    warm: JSON | None  # the rest as read, until `cool`
    packed: bytes = b""  # the rest deflated, once cool
    projected: tuple[str, str] | None = None  # (queue, phase) as last projected, for the gauges
    key: tuple[str, str] | None = None  # (namespace, name): the store's one tuple for the task and its Lease
    relabel: dict[str, str] | None = None  # the labels it lacks or has wrong (`labels.relabelled`), if any

    def json(self) -> JSON:
        """The Task as kept: while warm, the one dict every reader shares (read it, never change it)."""
        warm = self.warm  # `cool` sets `packed` before it drops `warm`: another thread may be here
        return warm if warm is not None else _TASKS.unpack(self.packed)

    def cool(self) -> None:
        if self.warm is not None:
            self.packed = _TASKS.pack(self.warm)
            self.warm = None


def slim(task: JSON) -> SlimTask:
    """Enough of `task` to decide and to write its status. The payload is left out (a status
    write takes the spec from the stored Task): only whether it is nested too deeply matters
    here, and a payload nested too deeply is kept to say so."""
    meta = task["metadata"]
    spec: JSON = task.get("spec") or {}
    if models.payload_depth(spec.get("payload")) <= models.MAX_PAYLOAD_DEPTH:
        spec = {k: v for k, v in spec.items() if k != "payload"}
    kept = {"apiVersion": task.get("apiVersion"), "kind": task.get("kind"),
            "metadata": {k: meta[k] for k in KEPT_METADATA if k in meta}, "spec": spec, "status": task.get("status")}
    # Interned: thousands of Tasks share a queue and a creation second.
    entry = SlimTask(queue=sys.intern(str(spec.get("queue", ""))),
                     created=sys.intern(str(meta.get("creationTimestamp", ""))),
                     version=version(str(meta.get("resourceVersion", ""))), warm=kept,
                     relabel=labels.relabelled(task) or None)
    if "payload" in spec:
        entry.cool()  # nested too deeply, and perhaps huge: never kept as read
    return entry


def version(resource_version: str) -> int:
    """A resourceVersion as the number the API server makes it (an etcd revision), or -1."""
    return int(resource_version) if resource_version.isascii() and resource_version.isdigit() else -1


@dataclass(slots=True)
class SlimLease:
    """One Lease as the reconciler keeps it: what a Pod's deletion and a write's race are
    decided with, and the Lease as it was read, warm (decoded) or deflated."""

    held_by_pod: str  # the holder's Pod while held, else ""
    resource_version: str
    warm: LeaseRecord | None  # until `cool`
    packed: bytes = b""  # once cool
    key: tuple[str, str] | None = None  # as `SlimTask.key`

    def record(self) -> LeaseRecord:
        warm = self.warm  # as in `SlimTask.json`
        return warm if warm is not None else record.decode(_LEASES.unpack(self.packed))

    def cool(self) -> None:
        """Deflated, without what it does not decide with (`rec.raw`'s other fields)."""
        if self.warm is not None:
            meta = self.warm.raw.get("metadata") or {}
            self.packed = _LEASES.pack({"metadata": {k: meta[k] for k in KEPT_LEASE_METADATA if k in meta},
                                        "spec": self.warm.raw.get("spec") or {}})
            self.warm = None


def slim_lease(rec: LeaseRecord) -> SlimLease:
    """`rec` as read from the API server (`rec.raw`), warm."""
    return SlimLease(held_by_pod=rec.holder_pod if rec.state == record.HELD else "",
                     resource_version=rec.resource_version, warm=rec)


class _Coolable(Protocol):
    def cool(self) -> None: ...


C = TypeVar("C", bound=_Coolable)


class Warm(Generic[C]):
    """The objects last stored, at most `size`, kept warm; the one stored before them is to
    cool. One that was replaced is simply dropped (only what the store holds is cooled)."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._held: OrderedDict[Hashable, C] = OrderedDict()

    def add(self, key: Hashable, obj: C) -> C | None:
        """Keep `obj` warm; the one that must cool now, if any (the caller cools it, once
        outside its lock)."""
        self._held[key] = obj
        self._held.move_to_end(key)
        return self._held.popitem(last=False)[1] if len(self._held) > self._size else None

    def discard(self, key: Hashable) -> None:
        self._held.pop(key, None)

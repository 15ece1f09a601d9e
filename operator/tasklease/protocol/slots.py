"""A queue's concurrency limit: a counting semaphore of slot Leases, one per task held.

A TaskQueue with `spec.maxRunning: N` has N slots, Leases named `tasklease-slot.<queue>.<i>`
for i < N, labelled `tasklease.dev/slot-of=<queue>`. An agent takes a free slot (a create,
409 when another agent made it first, or a PATCH conditional on the free slot's
resourceVersion) before it claims, and claims only while its slot is fresh (`FRESH_S` since
its last write of it): at most N holders can hold a slot, so at most N task Leases of the
queue are held at once. An agent gives its slot back once its task has ended; one it keeps
it writes again (`touch`) before its next claim.

The operator frees a slot whose holder holds fewer task Leases of the queue than slots, when
the slot has not been written for `STALE_S` by the operator's clock and a fresh read of the
queue's Leases shows the surplus (the agent died, or did not give it back): the agent wrote
the slot no later than the operator first saw that version, and claims within `FRESH_S` of
that write, so any claim made under that slot is in the read. Its write is conditional on
the version it saw: an agent that wrote the slot meanwhile keeps it. The admission policy
(`policy`) lets an agent hold a slot only in its own pod's name; the operator takes back a
claim not covered by a slot of its holder (docs/security.md).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final

from tasklease.api import errors
from tasklease.api.timestamps import format_time
from tasklease.kube import JSON, LEASES, Kube
from tasklease.protocol.record import label_value

LABEL_SLOT_OF: Final = "tasklease.dev/slot-of"
PREFIX: Final = "tasklease-slot."
DURATION_S: Final = 30  # what a slot says; the operator frees it by the rule above, not by this
FRESH_S: Final = 2.0  # an agent claims under a slot only this long after writing it
STALE_S: Final = 10.0  # the operator frees a surplus slot unwritten this long (well above FRESH_S)


def slot_name(queue: str, index: int) -> str:
    return f"{PREFIX}{queue}.{index}"


def selector(queue: str | None = None) -> str:
    return LABEL_SLOT_OF if queue is None else f"{LABEL_SLOT_OF}={label_value(queue)}"


@dataclass(frozen=True)
class Slot:
    name: str
    namespace: str
    queue: str
    index: int
    holder: str  # "" when free
    version: str


def decode(obj: JSON) -> Slot | None:
    """None for a Lease that is no well-formed slot (its name does not say its queue and index)."""
    meta = obj["metadata"]
    queue = (meta.get("labels") or {}).get(LABEL_SLOT_OF, "")
    prefix = slot_name(queue, 0)[:-1]
    name: str = meta["name"]
    if not queue or not name.startswith(prefix) or not name[len(prefix):].isdigit():
        return None
    return Slot(name=name, namespace=meta.get("namespace", ""), queue=queue, index=int(name[len(prefix):]),
                holder=(obj.get("spec") or {}).get("holderIdentity") or "", version=meta.get("resourceVersion", ""))


def free_indices(slots: Iterable[Slot], limit: int, rand: Callable[[], float] = random.random) -> list[int]:
    """The slots below `limit` no one holds, in random order (agents spread over them)."""
    held = {s.index for s in slots if s.holder}
    free = [i for i in range(limit) if i not in held]
    return sorted(free, key=lambda _: rand())


def acquire(kube: Kube, known: Iterable[Slot], *, namespace: str, queue: str, holder: str, limit: int,
            rand: Callable[[], float] = random.random) -> Slot | None:
    """Take a free slot of `queue` for `holder`, by the slots `known` (a watch's picture); None
    when all `limit` are held, or were taken from under us (each write is conditional)."""
    found = {s.index: s for s in known if s.queue == label_value(queue)}
    for index in free_indices(found.values(), limit, rand):
        slot = found.get(index)
        try:
            if slot is None:
                obj = kube.create(LEASES, _body(kube, queue, index, holder), namespace=namespace, timeout=5)
            else:
                obj = _write(kube, slot, holder)
        except (errors.Conflict, errors.NotFound):
            continue  # another agent was first
        taken = decode(obj)
        if taken is not None:
            return taken
    return None


def touch(kube: Kube, slot: Slot) -> Slot:
    """Write our slot again before a claim under it; Conflict/NotFound when it is not ours any more."""
    taken = decode(_write(kube, slot, slot.holder))
    if taken is None:
        raise errors.Conflict(f"lease {slot.namespace}/{slot.name} is no slot any more")
    return taken


def release(kube: Kube, slot: Slot) -> bool:
    """Free `slot` as last seen; False when it moved meanwhile (written again: still its holder's)."""
    with contextlib.suppress(errors.Conflict, errors.NotFound):
        kube.merge_patch(LEASES, slot.name, {"metadata": {"resourceVersion": slot.version},
                                             "spec": {"holderIdentity": None}}, namespace=slot.namespace, timeout=5)
        return True
    return False


def _write(kube: Kube, slot: Slot, holder: str) -> JSON:
    now = format_time(kube.now())
    return kube.merge_patch(LEASES, slot.name, {
        "metadata": {"resourceVersion": slot.version},
        "spec": {"holderIdentity": holder, "leaseDurationSeconds": DURATION_S, "renewTime": now,
                 **({} if slot.holder == holder else {"acquireTime": now})}}, namespace=slot.namespace, timeout=5)


def _body(kube: Kube, queue: str, index: int, holder: str) -> JSON:
    now = format_time(kube.now())
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": slot_name(queue, index), "labels": {LABEL_SLOT_OF: label_value(queue)}},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": DURATION_S, "acquireTime": now,
                     "renewTime": now}}


def held_per_holder(slots: Iterable[Slot]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for s in slots:
        if s.holder:
            counts[s.holder] = counts.get(s.holder, 0) + 1
    return counts


def surplus(slots: Iterable[Slot], held_by: dict[str, int]) -> dict[str, int]:
    """Per holder, how many slots it holds beyond the task Leases it holds (`held_by`)."""
    return {h: n - held_by.get(h, 0) for h, n in held_per_holder(slots).items() if n > held_by.get(h, 0)}


def uncovered(slots: Iterable[Slot], held_by: dict[str, int]) -> dict[str, int]:
    """Per holder, how many task Leases it holds beyond its slots: claims made without one."""
    counts = held_per_holder(slots)
    return {h: n - counts.get(h, 0) for h, n in held_by.items() if n > counts.get(h, 0)}

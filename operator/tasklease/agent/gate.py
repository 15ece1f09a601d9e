"""A queue's controls (its TaskQueue) as an agent obeys them before each claim.

`QueueGate.admit` says whether a claim may be tried now: not while the queue is paused,
not before a token of its claim rate (`protocol.rate`), not without a slot of the queue's
semaphore (`protocol.slots`) when it has `maxRunning`. A watch of the one TaskQueue keeps
the picture, and under `maxRunning` one of the queue's slot Leases: an agent that waits for
a slot makes no request until one is free. A slot stays bound to the claim made under it
until that claim ends; the next claim reuses it (written again first, when it is no longer
fresh), and `trim` gives back the ones no claim uses once there is nothing to claim.

Without a TaskQueue (or without the TaskQueue CRD) the gate admits every claim.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from pydantic import ValidationError

from tasklease.agent.claimed import ClaimedTask
from tasklease.api import errors
from tasklease.api.queues import TaskQueueSpec
from tasklease.kube import JSON, LEASES, TASKQUEUES, Kube
from tasklease.kube.watching import Reflector
from tasklease.protocol import HELD, Protocol, rate, slots
from tasklease.protocol.slots import Slot

log = logging.getLogger(__name__)

WAIT_S = 0.5  # how long a gated claim waits before asking the gate again (a local look, no request)
_SYNC_S = 10.0
_CLOCK_WAIT_S = 1.0


@dataclass
class Admission:
    wait_s: float = 0.0  # > 0: claim nothing now; ask again after this long (or sooner, on news)
    why: str = ""
    slot: Slot | None = None  # the slot to claim under


@dataclass
class _Bound:
    slot: Slot
    written: float  # monotonic seconds of our last write of it
    claim: ClaimedTask | None = None
    reserved: bool = True  # handed to a claim being tried

    def spare(self, protocol: Protocol) -> bool:
        """No claim uses the slot: none was made under it, or its task's Lease is ours no more
        (a claim `detach`ed is finished here, yet still held by the process it went to)."""
        if self.reserved:
            return False
        claim = self.claim
        if claim is None or claim.lost.is_set():
            return True
        if not claim.finished:
            return False
        rec = protocol.read(claim.namespace, claim.name, timeout=5)
        ours = rec is not None and rec.state == HELD and (rec.holder, rec.epoch) == (claim.holder, claim.epoch)
        if not ours:
            self.claim = None  # read once
        return not ours


class QueueGate:
    """One queue's gate for one agent identity. Thread-safe."""

    def __init__(self, kube: Kube, *, namespace: str, queue: str, holder: str,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.kube, self.namespace, self.queue, self.holder = kube, namespace, queue, holder
        self.monotonic = monotonic
        self.protocol = Protocol(kube)
        self._lock = threading.Lock()
        self._spec = TaskQueueSpec()
        self._slots: dict[str, Slot] = {}
        self._mine: list[_Bound] = []
        self._queue_watch = Reflector(kube, TASKQUEUES, namespace=namespace, listener=self._on_queue,
                                      field_selector=f"metadata.name={queue}")
        self._slot_watch: Reflector | None = None  # from the first claim under maxRunning
        self._waited = False

    def start(self) -> None:
        """Its watch lists while the claim reads the queue; the first `admit` waits for the list."""
        self._queue_watch.start()

    def stop(self) -> None:
        self.trim()
        for watch in (self._queue_watch, self._slot_watch):
            if watch is not None:
                watch.stop()

    def _synced(self, watch: Reflector) -> None:
        deadline = self.monotonic() + _SYNC_S
        # A watch stopped for good (no TaskQueue CRD, no rights) never syncs: no need to wait it out.
        while not watch.synced.wait(0.05) and not watch.stopped and self.monotonic() < deadline:
            pass
        if not watch.synced.is_set() and not isinstance(watch.error, errors.CRDMissing):
            log.warning("queue %s: the %s watch did not start: claims are not gated until it does",
                        self.queue, watch.resource.plural)

    def _watch_slots(self) -> None:
        with self._lock:
            if self._slot_watch is not None:
                return
            self._slot_watch = Reflector(self.kube, LEASES, namespace=self.namespace, listener=self._on_slot,
                                         label_selector=slots.selector(self.queue))
        self._slot_watch.start()
        self._synced(self._slot_watch)

    def admit(self) -> Admission:
        if not self._waited:  # once: a watch that does not list leaves claims ungated (`_synced`)
            self._synced(self._queue_watch)
            self._waited = True
        with self._lock:
            spec = self._spec
            if spec.paused:
                return Admission(WAIT_S, f"queue {self.queue} is paused")
        if spec.claims_per_second is not None:
            wait = rate.take(self.kube, namespace=self.namespace, queue=self.queue, rate=spec.claims_per_second)
            if wait > 0:
                return Admission(min(wait, WAIT_S), f"queue {self.queue} is at its claim rate")
        if spec.max_running is None:
            return Admission()
        self._watch_slots()
        with self._lock:
            mine, known = list(self._mine), list(self._slots.values())
        spare = next((b for b in mine if b.spare(self.protocol)), None)
        with self._lock:
            if spare is not None and not spare.reserved and spare in self._mine:
                spare.reserved, spare.claim = True, None
            else:
                spare = None
        if spare is not None:
            if self.monotonic() - spare.written < slots.FRESH_S:
                return Admission(slot=spare.slot)
            try:
                spare.slot, spare.written = slots.touch(self.kube, spare.slot), self.monotonic()
                return Admission(slot=spare.slot)
            except (errors.Conflict, errors.NotFound):  # the operator freed it: not ours any more
                with self._lock:
                    self._mine.remove(spare)
        written = self.monotonic()
        slot = slots.acquire(self.kube, known, namespace=self.namespace, queue=self.queue, holder=self.holder,
                             limit=spec.max_running)
        if slot is None:
            return Admission(WAIT_S, f"queue {self.queue} runs its maxRunning ({spec.max_running}) tasks")
        with self._lock:
            self._mine.append(_Bound(slot, written))
        return Admission(slot=slot)

    def bind(self, admission: Admission, claim: ClaimedTask | None) -> None:
        """`claim` was made under `admission`'s slot (None: no claim was): the slot is its until it ends."""
        with self._lock:
            for bound in self._mine:
                if bound.slot == admission.slot:
                    bound.claim, bound.reserved = claim, False

    def trim(self) -> None:
        """Give back the slots no running claim uses."""
        with self._lock:
            mine = list(self._mine)
        spare = [b for b in mine if b.spare(self.protocol)]
        with self._lock:
            spare = [b for b in spare if not b.reserved and b in self._mine]
            self._mine = [b for b in self._mine if b not in spare]
        for bound in spare:
            slots.release(self.kube, bound.slot)

    def _on_queue(self, kind: str, obj: JSON) -> None:
        try:
            spec = TaskQueueSpec() if kind == "DELETED" else TaskQueueSpec.model_validate(obj.get("spec") or {})
        except ValidationError as exc:  # the CRD's schema refuses this; an older CRD may not
            log.warning("queue %s: TaskQueue spec ignored: %s", self.queue, str(exc).splitlines()[0])
            spec = TaskQueueSpec()
        with self._lock:
            self._spec = spec

    def _on_slot(self, kind: str, obj: JSON) -> None:
        slot = slots.decode(obj)
        if slot is None:
            return
        with self._lock:
            if kind == "DELETED":
                self._slots.pop(slot.name, None)
            else:
                self._slots[slot.name] = slot


class Gates:
    """The gates of one agent's queues, made on first use. Thread-safe."""

    def __init__(self, kube: Kube, *, namespace: str, holder: str) -> None:
        self.kube, self.namespace, self.holder = kube, namespace, holder
        self._lock = threading.Lock()
        self._gates: dict[str, QueueGate] = {}

    def open(self, queue: str) -> None:
        """Start the queue's gate (its watch lists meanwhile)."""
        self._gate(queue)

    def admit(self, queue: str, *, wanted: bool) -> Admission:
        """Whether to try a claim now; `wanted`: there is something to claim (else spare slots go back)."""
        gate = self._gate(queue)
        if not wanted:
            gate.trim()
            return Admission()
        return gate.admit()

    def bind(self, queue: str, admission: Admission, claim: ClaimedTask | None) -> None:
        if admission.slot is not None:
            self._gate(queue).bind(admission, claim)

    def close(self) -> None:
        with self._lock:
            gates, self._gates = list(self._gates.values()), {}
        for gate in gates:
            gate.stop()

    def _gate(self, queue: str) -> QueueGate:
        with self._lock:
            gate = self._gates.get(queue)
            if gate is None:
                gate = self._gates[queue] = QueueGate(self.kube, namespace=self.namespace, queue=queue,
                                                      holder=self.holder)
                gate.start()
            return gate


def queue_controls(kube: Kube, *, namespace: str, queue: str) -> TaskQueueSpec | None:
    """The controls the queue's TaskQueue sets (None: no TaskQueue, no such CRD, or a spec
    that is not one: no control)."""
    try:
        obj = kube.get_or_none(TASKQUEUES, queue, namespace=namespace)
    except errors.CRDMissing:
        return None
    try:
        return TaskQueueSpec.model_validate((obj or {}).get("spec") or {})
    except ValidationError:
        return None


def admit_once(kube: Kube, spec: TaskQueueSpec | None, *, namespace: str, queue: str, holder: str) -> Slot | None:
    """For a one-shot claim (the CLI), under the queue's controls (`queue_controls`): the slot
    to claim under (None: no limit). NothingToClaim when the queue is paused or runs its
    maxRunning tasks. The slot goes back with `slots.release` when nothing was claimed; else
    the operator frees it once the task has ended."""
    if spec is None:
        return None
    if spec.paused:
        raise errors.NothingToClaim(f"queue {queue!r} is paused")
    if spec.claims_per_second is not None:
        wait = rate.take(kube, namespace=namespace, queue=queue, rate=spec.claims_per_second)
        if 0 < wait <= _CLOCK_WAIT_S:  # what a new process cannot yet tell of the server's clock: wait it out
            time.sleep(wait)
            wait = rate.take(kube, namespace=namespace, queue=queue, rate=spec.claims_per_second)
        if wait > 0:
            raise errors.NothingToClaim(f"queue {queue!r} is at its claim rate ({spec.claims_per_second:g}/s)")
    if spec.max_running is None:
        return None
    known = [s for o in kube.list(LEASES, namespace=namespace, label_selector=slots.selector(queue))["items"]
             if (s := slots.decode(o)) is not None]
    slot = slots.acquire(kube, known, namespace=namespace, queue=queue, holder=holder, limit=spec.max_running)
    if slot is None:
        raise errors.NothingToClaim(f"queue {queue!r} runs its maxRunning ({spec.max_running}) tasks")
    return slot


class OneShotAdmission:
    """A one-shot claim's admission: the queue's controls as `controls` will read them (read
    while the queue's tasks are), applied by the first call, before the first claim write;
    later calls do nothing. `give_back` when nothing was claimed."""

    def __init__(self, kube: Kube, controls: Future[TaskQueueSpec | None], *, namespace: str, queue: str,
                 holder: str) -> None:
        self.kube, self.controls = kube, controls
        self.namespace, self.queue, self.holder = namespace, queue, holder
        self.admitted = False
        self.slot: Slot | None = None

    def __call__(self) -> None:
        if not self.admitted:
            self.slot = admit_once(self.kube, self.controls.result(), namespace=self.namespace, queue=self.queue,
                                   holder=self.holder)
            self.admitted = True

    def give_back(self) -> None:
        if self.slot is not None:
            slots.release(self.kube, self.slot)
            self.slot = None


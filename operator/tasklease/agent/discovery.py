"""What an agent can claim in one queue, kept current by two server-filtered watches.

Tasks are selected by the API server on `spec.queue` (a CRD selectable field) and Leases
by the `tasklease.dev/queue` label, so an agent downloads only its own queue. No polling:
a waiting agent sleeps until a watch event arrives or the earliest backoff runs out.
"""

from __future__ import annotations

import random
import threading
import time
from datetime import datetime

from tasklease.api import errors, models, timestamps
from tasklease.protocol import record
from tasklease.kube import JSON, LEASES, TASKS, Kube
from tasklease.protocol import LeaseRecord, TaskView, why_not_claimable
from tasklease.kube.watching import Reflector



def task_selector(queue: str) -> str:
    """Tasks of `queue` whose projected phase is not terminal (the server filters)."""
    return ",".join([f"spec.queue={queue}", *(f"status.phase!={p}" for p in models.TERMINAL_PHASES)])


def lease_selector(queue: str) -> str:
    # Not `state!=closed`: when an object stops matching a selector the watch reports it
    # DELETED with its *previous* state, so a closing Lease would look like a vanished one.
    return f"{record.LABEL_QUEUE}={queue}"


def claimable(tasks: dict[str, TaskView], leases: dict[str, LeaseRecord],
              now: datetime) -> list[tuple[TaskView, LeaseRecord | None]]:
    """The tasks that may be claimed now, each with its Lease (None: never claimed)."""
    return [(t, leases.get(name)) for name, t in tasks.items()
            if why_not_claimable(t, leases.get(name), now) is None]


class QueueView:
    """A live, thread-safe picture of one queue's open tasks and their Leases."""

    def __init__(self, kube: Kube, *, namespace: str, queue: str) -> None:
        self.queue = queue
        self._tasks: dict[str, TaskView] = {}
        self._leases: dict[str, LeaseRecord] = {}
        self._lost: dict[str, str] = {}  # name → Lease resourceVersion we lost a race on
        self._changed = threading.Condition()
        self._generation = 0
        self._reflectors = [
            Reflector(kube, TASKS, namespace=namespace, field_selector=task_selector(queue),
                      listener=self._on_task),
            Reflector(kube, LEASES, namespace=namespace, label_selector=lease_selector(queue),
                      listener=self._on_lease),
        ]

    def start(self, timeout_s: float = 30.0) -> None:
        for r in self._reflectors:
            r.start()
        deadline = time.monotonic() + timeout_s
        for r in self._reflectors:
            while not r.synced.wait(0.1):
                # Refusals are final (RBAC, a missing CRD); a flaky network gets until the deadline.
                final = r.error is not None and not isinstance(r.error, (errors.Unreachable, errors.ServerError))
                if final or time.monotonic() > deadline:
                    self.stop()
                    if isinstance(r.error, errors.TaskleaseError):
                        raise r.error
                    raise errors.Unreachable(f"the watch of queue {self.queue!r} did not start: "
                                             f"{r.error or f'no answer in {timeout_s:.0f}s'}")

    def stop(self) -> None:
        for r in self._reflectors:
            r.stop()

    def candidates(self, now: datetime) -> list[tuple[TaskView, LeaseRecord | None]]:
        with self._changed:
            fresh = {name: t for name, t in self._tasks.items() if not self._recently_lost(name)}
            return claimable(fresh, self._leases, now)

    def next_not_before(self) -> datetime | None:
        """The earliest backoff still running among open tasks: when to look again without an event."""
        now = timestamps.now_utc()
        with self._changed:
            times = [r.not_before for name, r in self._leases.items()
                     if r.not_before is not None and r.not_before > now and r.state == record.FREE
                     and name in self._tasks]
        return min(times) if times else None

    def generation(self) -> int:
        with self._changed:
            return self._generation

    def wait_for_change(self, since: int, timeout_s: float) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self._generation != since, timeout=timeout_s)

    def mark_lost(self, name: str) -> None:
        """After a lost race: skip `name` until its Lease is seen to change."""
        with self._changed:
            current = self._leases.get(name)
            self._lost[name] = current.resource_version if current else ""

    def _on_task(self, kind: str, obj: JSON) -> None:
        name = obj["metadata"]["name"]
        with self._changed:
            if kind == "DELETED":
                # Finished (it left the phase selector) or deleted: its Lease no longer matters.
                self._tasks.pop(name, None)
                self._leases.pop(name, None)
            else:
                self._tasks[name] = TaskView.of(obj)
            self._bump()

    def _on_lease(self, kind: str, obj: JSON) -> None:
        rec = record.decode(obj)
        with self._changed:
            if kind == "DELETED":
                self._leases.pop(rec.name, None)
            else:
                self._leases[rec.name] = rec
            self._bump()

    def _recently_lost(self, name: str) -> bool:
        if name not in self._lost:
            return False
        current = self._leases.get(name)
        if (current.resource_version if current else "") == self._lost[name]:
            return True
        del self._lost[name]
        return False

    def _bump(self) -> None:
        self._generation += 1
        self._changed.notify_all()


def pick(candidates: list[tuple[TaskView, LeaseRecord | None]], *, best_of: int,
         rng: random.Random) -> list[tuple[TaskView, LeaseRecord | None]]:
    """The few to try now: the `best_of` highest-priority (then oldest) candidates, shuffled,
    so that a fleet woken by the same event does not race for the same task. The rest wait
    for the next look, when the winners' Leases have arrived through the watch."""
    ranked = sorted(candidates, key=lambda c: (-c[0].spec.priority, c[0].created, c[0].name))
    head = ranked[:best_of]
    rng.shuffle(head)
    return head

"""This agent's membership of a queue: its member Lease (`protocol.members`), kept by a thread.

Written at once on joining, then every third of its duration (liveness), and when a task we
claimed by creating its Lease has not been projected by the operator within `TELL_S`: then
one write tells the peers of every such claim. Left on `close`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from tasklease.api import errors
from tasklease.kube import JSON
from tasklease.protocol.members import DURATION_S, TELL_S, MemberLease

log = logging.getLogger(__name__)

_RETRY_S: Final = 1.0


@dataclass(frozen=True)
class Writes:
    """Successful writes of member Leases (the bench counts them)."""

    told: int = 0  # that told of claims: per claim the operator did not project in time
    liveness: int = 0  # that only said we are here (or left): per agent and time, not per task

    def __add__(self, other: Writes) -> Writes:
        return Writes(told=self.told + other.told, liveness=self.liveness + other.liveness)


class Membership:
    """This agent's member Lease in one queue, written by a thread of its own from `start` to `close`."""

    def __init__(self, lease: MemberLease, *, holding: Callable[[], int]) -> None:
        """`holding`: how many leases the agent holds now."""
        self._lease = lease
        self._holding = holding
        self._untold: dict[str, float] = {}  # name → when we took it, oldest first
        self._urgent = False
        self._wake = threading.Condition()
        self._stopping = False
        self.writes = Writes()
        self._thread = threading.Thread(target=self._run, name=f"member-{lease.name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def took(self, name: str, *, created: bool, stolen: bool) -> None:
        """We claimed `name`. A claim of a free Lease told our peers itself (the Lease left their
        watch); one that `created` its Lease is told by the operator's projection of the Task or,
        failing that within `TELL_S`, by us; at once if we `stole` it from another member, whose
        other thieves hold back only briefly."""
        if not created:
            return
        with self._wake:
            # The thread wakes only when its next write comes sooner: for the first claim to
            # tell, or a theft. Waking it for every claim cost a thread switch per task.
            sooner = not self._untold or (stolen and not self._urgent)
            self._untold.setdefault(name, time.monotonic())
            self._urgent = self._urgent or stolen
            if sooner:
                self._wake.notify()

    def seen(self, kind: str, task: JSON) -> None:
        """A Task event of our queue (every agent of it sees the same): a task projected
        Running, or gone from the open tasks, is known taken to our peers without us."""
        name = task["metadata"]["name"]
        if name in self._untold and (kind == "DELETED" or (task.get("status") or {}).get("attempt")):
            with self._wake:
                self._untold.pop(name, None)

    def close(self) -> None:
        """Leave: our peers stop counting us at once, and divide our share among themselves."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=10)

    def _due(self, last: float, not_before: float) -> float:
        """Caller holds the lock. Seconds until the next write."""
        now = time.monotonic()
        due = last + DURATION_S / 3 - now
        if self._urgent:
            due = 0.0
        elif self._untold:
            due = min(due, next(iter(self._untold.values())) + TELL_S - now)
        return max(due, not_before - now)

    def _tell(self) -> dict[str, float]:
        """Caller holds the lock. Takes the claims this write tells of: all of them once one was
        stolen, or one was not projected within TELL_S (the younger ones too: one write for
        several); none in a write that only says we are alive (they may still be projected)."""
        overdue = bool(self._untold) and next(iter(self._untold.values())) <= time.monotonic() - TELL_S
        due, self._urgent = self._urgent or overdue, False
        if not due:
            return {}
        told, self._untold = self._untold, {}
        return told

    def _run(self) -> None:
        last, not_before = -math.inf, 0.0  # write at once: we are at work from now on
        while True:
            with self._wake:
                while not self._stopping and (due := self._due(last, not_before)) > 0:
                    self._wake.wait(due)
                stopping = self._stopping
                told = {} if stopping else self._tell()  # leaving: our peers stop dividing with us
            try:
                if not self._lease.write(list(told), 0 if stopping else self._holding(), left=stopping):
                    log.warning("Lease %s is not a member Lease (a Task of that name?): this agent works "
                                "without telling its peers, who may race it more", self._lease.name)
                    return
                self.writes += Writes(told=1) if told else Writes(liveness=1)
                last = time.monotonic()
            except errors.TaskleaseError as exc:  # our peers count us for DURATION_S: try again soon
                log.warning("could not write member Lease %s: %s", self._lease.name, exc)
                with self._wake:
                    self._untold = {**told, **self._untold}
                not_before = time.monotonic() + _RETRY_S
            if stopping:
                return

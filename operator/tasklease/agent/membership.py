"""This agent's membership of a queue: its member Lease (`protocol.members`), kept by a thread.

Written at once on joining, then every third of its duration (liveness); when we start
claiming, and when we stop (`QUIET_S` after our last claim), telling then of the claims the
operator did not project; for a theft the operator did not project within `THEFT_TELL_S`; at
once when a peer comes or goes, when we move to a lower band or are held back from one, if
there is anything to tell; every `TELL_MAX` untold claims; when a claim has waited
`WAITING_S` for a task (that it waits; that it stopped is said by the next write). On
`close`, it tells what is left to tell, then is deleted (or, where the agent may not delete
it, says the agent left).
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
from tasklease.protocol.members import DURATION_S, QUIET_S, TELL_MAX, THEFT_TELL_S, WAITING_S, MemberLease

log = logging.getLogger(__name__)

_RETRY_S: Final = 1.0


@dataclass(frozen=True)
class Writes:
    """Successful writes of member Leases (the bench counts them)."""

    told: int = 0  # that told of claims the operator did not project: per agent and stop, not per task
    liveness: int = 0  # that only said we are here, claiming or not (or left): per agent and time

    def __add__(self, other: Writes) -> Writes:
        return Writes(told=self.told + other.told, liveness=self.liveness + other.liveness)


class Membership:
    """This agent's member Lease in one queue, written by a thread of its own from `start` to `close`."""

    def __init__(self, lease: MemberLease, *, holder: str, holding: Callable[[], int]) -> None:
        """`holder`: this agent; `holding`: how many leases it holds now."""
        self._lease = lease
        self._holder = holder
        self._holding = holding
        self._untold: dict[str, None] = {}  # claims to tell of, in order
        self._untold_top = 0  # the highest priority among them
        self._thefts: set[str] = set()  # untold claims taken from another member's share
        self._thefts_due = math.inf  # when they are told, unless seen projected first (monotonic)
        self._urgent = False  # tell now
        self._claimed_at = -math.inf  # our last claim (monotonic)
        self._claiming = False  # what our next write says
        self._said = False  # what our last write said
        self._waits: list[float] = []  # since when each claim waiting for a task now waits (monotonic)
        self._said_waiting = False  # what our last write said
        self._wake = threading.Condition()
        self._stopping = False
        self.writes = Writes()
        self._thread = threading.Thread(target=self._run, name=f"member-{lease.name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def took(self, name: str, *, created: bool, stolen: bool, priority: int = 0) -> None:
        """We claimed `name`, of band `priority`. A claim of a free Lease told our peers itself
        (the Lease left their watch); one that `created` its Lease is told by the operator's
        projection of the Task or, failing that, by us when we stop claiming (until then our
        peers leave our share to us); `THEFT_TELL_S` later if we `stole` it from another member
        and the operator has not projected it by then (its owner and its other thieves would
        race for it), or at once if we moved to a lower band than one we took untold (our peers
        hold their lower bands back for it)."""
        with self._wake:
            self._claimed_at = time.monotonic()
            # The thread wakes only when its next write comes sooner: the first claim says we
            # claim, a lower band or a full list tells, a theft may. Waking it for every claim
            # cost a thread switch per task.
            urgent = bool(self._untold) and priority < self._untold_top
            sooner = not self._claiming or (urgent and not self._urgent)
            self._claiming = True
            self._urgent = self._urgent or urgent
            if created:
                self._untold_top = max(self._untold_top, priority) if self._untold else priority
                self._untold[name] = None
                sooner = sooner or len(self._untold) == TELL_MAX
                if stolen:
                    self._thefts.add(name)
                    sooner = sooner or self._thefts_due == math.inf
                    self._thefts_due = min(self._thefts_due, time.monotonic() + THEFT_TELL_S)
            if sooner:
                self._wake.notify()

    def waiting(self) -> Callable[[], None]:
        """A claim of ours waits for a task, until the returned function is called: once it has
        waited `WAITING_S`, our peers hear that we take our shards' tasks as they come, and need
        not read them (`Agent._beyond`)."""
        since = time.monotonic()
        with self._wake:
            self._waits.append(since)
            if len(self._waits) == 1 and not self._said_waiting:
                self._wake.notify()  # to write when it has waited long enough

        def ended() -> None:
            with self._wake:
                self._waits.remove(since)  # an equal time of another wait serves as well
        return ended

    def held_back(self) -> None:
        """We may claim nothing now: a higher band is left to claiming peers (strict priority).
        They are likely held back likewise, by what we took untold: tell it."""
        if self._untold:
            with self._wake:
                if self._untold and not self._urgent:
                    self._urgent = True
                    self._wake.notify()

    def seen(self, kind: str, task: JSON) -> None:
        """A Task event of our queue (every agent of it sees the same): a task projected
        Running, or gone from the open tasks, is known taken to our peers without us."""
        name = task["metadata"]["name"]
        if name in self._untold and (kind == "DELETED" or (task.get("status") or {}).get("attempt")):
            with self._wake:
                self._untold.pop(name, None)
                self._thefts.discard(name)
                if not self._thefts:
                    self._thefts_due = math.inf

    def peers_changed(self, holder: str) -> None:
        """`holder` joined or left the queue: the tasks are divided anew, and some of what we
        took untold may be another's share now, as it sees it (it holds those back until we
        write, for a while: `QueueView`)."""
        if holder != self._holder and self._untold:
            with self._wake:
                self._urgent = True
                self._wake.notify()

    def close(self) -> None:
        """Leave: our peers stop counting us at once, and divide our share among themselves."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=10)

    def _due(self, last: float, not_before: float) -> float:
        """Caller holds the lock. Seconds until the next write."""
        now = time.monotonic()
        if self._urgent or self._claiming != self._said or len(self._untold) >= TELL_MAX:
            due = 0.0
        elif self._claiming:
            due = min(last + DURATION_S / 3, self._claimed_at + QUIET_S) - now  # alive, or quiet
        else:
            due = last + DURATION_S / 3 - now
        if self._waits and not self._said_waiting:
            due = min(due, min(self._waits) + WAITING_S - now)
        return max(min(due, self._thefts_due - now), not_before - now)

    def _next(self, *, leaving: bool) -> tuple[list[str], bool, bool]:
        """Caller holds the lock. What the write about to be made says: the claims it tells of,
        whether we claim, and whether we wait in a claim. All the claims once we stopped
        claiming (or are `leaving`), or it is urgent (a peer that came or went, a lower band), or
        a theft went unprojected (`THEFT_TELL_S`), or they are many; none while we claim (our
        peers leave our share to us)."""
        now = time.monotonic()
        self._claiming = self._claiming and not leaving and now - self._claimed_at < QUIET_S
        waiting = not leaving and any(now - since >= WAITING_S for since in self._waits)
        if not (self._urgent or not self._claiming or len(self._untold) >= TELL_MAX or self._thefts_due <= now):
            return [], True, waiting
        told, self._untold, self._urgent = list(self._untold), {}, False
        self._thefts, self._thefts_due = set(), math.inf
        return told, self._claiming, waiting

    def _run(self) -> None:
        last, not_before = -math.inf, 0.0  # write at once: we are at work from now on
        while True:
            with self._wake:
                while not self._stopping and (due := self._due(last, not_before)) > 0:
                    self._wake.wait(due)
                stopping = self._stopping
                told, claiming, waiting = self._next(leaving=stopping)
            if stopping and last == -math.inf:  # never written: our peers never counted us
                return
            try:
                # Leaving, the last write tells and still names us: it is what proves the Lease
                # ours when we delete it (the admission policy).
                if not self._lease.write(told, 0 if stopping else self._holding(), claiming=claiming,
                                         waiting=waiting):
                    log.warning("Lease %s is not a member Lease (a Task of that name?): this agent works "
                                "without telling its peers, who may race it more", self._lease.name)
                    return
                self.writes += Writes(told=1) if told else Writes(liveness=1)
                last = time.monotonic()
                with self._wake:
                    self._said, self._said_waiting = claiming, waiting
            except errors.TaskleaseError as exc:  # our peers count us for DURATION_S: try again soon
                log.warning("could not write member Lease %s: %s", self._lease.name, exc)
                with self._wake:
                    self._untold = {**dict.fromkeys(told), **self._untold}
                not_before = time.monotonic() + _RETRY_S
            if stopping:
                self._leave()
                return

    def _leave(self) -> None:
        """Delete our member Lease: our peers stop counting us at once. Where we may not (a role
        without the admission policy has no delete), or cannot now, say we left instead."""
        try:
            if self._lease.delete():
                return
            log.info("member Lease %s: this agent may not delete it; it says the agent left", self._lease.name)
        except errors.TaskleaseError as exc:
            log.warning("could not delete member Lease %s: %s", self._lease.name, exc)
        try:
            self._lease.write([], 0, left=True)
        except errors.TaskleaseError as exc:  # our peers stop counting us after DURATION_S
            log.warning("could not say in member Lease %s that this agent left: %s", self._lease.name, exc)

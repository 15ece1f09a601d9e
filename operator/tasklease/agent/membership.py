"""This agent's membership of a queue: its member Lease (`protocol.members`), kept by a thread.

Written at once on joining, then every third of its duration (liveness), and within
`PUBLISH_S` of a claim: one write tells the peers of several claims. Left on `close`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Final

from tasklease.api import errors
from tasklease.protocol.members import DURATION_S, MemberLease

log = logging.getLogger(__name__)

PUBLISH_S: Final = 0.5  # how long a claim may wait to be told, so that one write tells several
_RETRY_S: Final = 1.0


class Membership:
    """This agent's member Lease in one queue, written by a thread of its own from `start` to `close`."""

    def __init__(self, lease: MemberLease, *, holding: Callable[[], int]) -> None:
        """`holding`: how many leases the agent holds now."""
        self._lease = lease
        self._holding = holding
        self._took: list[str] = []
        self._urgent = False
        self._wake = threading.Condition()
        self._stopping = False
        self.writes = 0  # successful writes of our member Lease (the bench counts them)
        self._thread = threading.Thread(target=self._run, name=f"member-{lease.name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def took(self, name: str, *, stolen: bool = False) -> None:
        """We claimed `name`: our peers hear of it with the next write; at once if we `stole`
        it from another member, whose other thieves hold back only briefly."""
        with self._wake:
            self._took.append(name)
            self._urgent = self._urgent or stolen
            self._wake.notify()

    def close(self) -> None:
        """Leave: our peers stop counting us at once, and divide our share among themselves."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        renew_s = DURATION_S / 3
        last = -renew_s  # write at once: we are at work from now on
        while True:
            with self._wake:
                while not self._stopping:
                    due = (0 if self._urgent else PUBLISH_S if self._took else renew_s) - (time.monotonic() - last)
                    if due <= 0:
                        break
                    self._wake.wait(due)
                stopping, took, self._took, self._urgent = self._stopping, self._took, [], False
            try:
                if not self._lease.write(took, 0 if stopping else self._holding(), left=stopping):
                    log.warning("Lease %s is not a member Lease (a Task of that name?): this agent works "
                                "without telling its peers, who may race it more", self._lease.name)
                    return
                self.writes += 1
                last = time.monotonic()
            except errors.TaskleaseError as exc:  # our peers count us for DURATION_S: try again soon
                log.warning("could not write member Lease %s: %s", self._lease.name, exc)
                with self._wake:
                    self._took[:0] = took
                last = time.monotonic() - renew_s + _RETRY_S
            if stopping:
                return

"""Leader election on a coordination.k8s.io Lease, the client-go algorithm in Python.

Why not kopf peering: peering pauses lower-priority replicas but with equal priorities
pauses them all, and it is not a lock. Why a Lease: it is what kube-controller-manager
uses, and the same observed-time rule as task expiry applies: a candidate takes over
when the leader's record has not changed for `lease_duration_s` *as observed locally*,
never by comparing the remote renewTime with its own clock.

Leadership only decides who acts; safety never depends on it. Every write the operator
makes is conditional, so two replicas that both believe they lead (a partition, a GC
pause) can waste work but cannot break an invariant.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tasklease.api import errors
from tasklease.kube import Kube
from tasklease.protocol.election import ElectionLock

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ElectionConfig:
    namespace: str
    name: str = "tasklease-operator"
    lease_duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0

    def __post_init__(self) -> None:
        # The same relations client-go checks: a leader gives up before anyone may take over.
        if not self.lease_duration_s > self.renew_deadline_s > self.retry_period_s * 1.2 > 0:
            raise ValueError("need lease_duration > renew_deadline > 1.2 x retry_period > 0")


class LeaderElector:
    def __init__(self, kube: Kube, config: ElectionConfig, *, identity: str,
                 on_started: Callable[[], None], on_stopped: Callable[[], None],
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.kube = kube
        self.config = config
        self.identity = identity
        self.on_started = on_started
        self.on_stopped = on_stopped
        self.monotonic = monotonic
        self.leading = threading.Event()
        # Set once the first campaign step has ended (and on_started has run if it won):
        # until then nobody knows whether we lead, so readiness waits for it.
        self.decided = threading.Event()
        self._stop = threading.Event()
        self._observed_rv = ""
        self._observed_at = 0.0
        self._lock = ElectionLock(kube, namespace=config.namespace, name=config.name)
        self._thread = threading.Thread(target=self._run, name="leader-election", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        """False once the election thread has died (liveness reports it); True before start."""
        return self._thread.is_alive() or self._thread.ident is None or self._stop.is_set()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop campaigning: hand over the Lease if we lead, and call on_stopped."""
        self._stop.set()
        self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        try:
            self._campaign()
        except Exception:  # noqa: BLE001 - say why, step down; liveness reports the dead thread
            log.exception("leader election stopped")
        finally:
            if self.leading.is_set():
                self._release()
                self._step_down()

    def _campaign(self) -> None:
        last_renew = 0.0
        while not self._stop.is_set():
            acquired = self._try_acquire_or_renew()
            now = self.monotonic()
            if acquired:
                last_renew = now
                if not self.leading.is_set():
                    log.info("became the leader (%s/%s as %s)", self.config.namespace, self.config.name, self.identity)
                    self.leading.set()
                    try:
                        self.on_started()
                    except Exception:  # noqa: BLE001 - a leader that cannot act must not keep the Lease
                        log.exception("could not start leading; handing over")
                        self._release()
                        self._step_down()
            elif self.leading.is_set() and now - last_renew > self.config.renew_deadline_s:
                log.warning("lost leadership: no renewal for %.0fs", self.config.renew_deadline_s)
                self._step_down()
            self.decided.set()
            self._stop.wait(self.config.retry_period_s)

    def _step_down(self) -> None:
        self.leading.clear()
        try:
            self.on_stopped()
        except Exception:  # noqa: BLE001
            log.exception("stepping down failed")

    def _try_acquire_or_renew(self) -> bool:
        """One step, numbered like client-go's tryAcquireOrRenew."""
        # An answer later than this is useless: we must be able to give up within the renew deadline.
        timeout = max(self.config.renew_deadline_s / 2, 0.5)
        try:
            # 1. Obtain the record (None: nobody has created it yet).
            current = self._lock.read(timeout=timeout)
            if current is not None:
                # 2. Note when the record last changed, on our own clock.
                if current.resource_version != self._observed_rv:
                    self._observed_rv, self._observed_at = current.resource_version, self.monotonic()
                # 3. Someone else holds it and has renewed within the lease duration: wait.
                if current.holder and current.holder != self.identity and \
                        self.monotonic() < self._observed_at + self.config.lease_duration_s:
                    return False
            # 4. Ours, free or expired: a create or a conditional update.
            updated = self._lock.hold(current, self.identity, duration_s=self.config.lease_duration_s,
                                      timeout=timeout)
            self._observed_rv, self._observed_at = updated.resource_version, self.monotonic()
            return True
        except errors.Conflict:
            return False
        except errors.TaskleaseError as exc:
            log.warning("leader election: %s", exc)
            return False

    def _release(self) -> None:
        """On a clean shutdown hand over at once instead of after a lease duration."""
        try:
            self._lock.release(self.identity)
        except errors.TaskleaseError as exc:
            log.info("leader election: release skipped (%s)", exc)

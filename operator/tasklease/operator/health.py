"""Readiness and liveness: our rights, our threads, the Task CRD, and the watches (ours and kopf's).

`Health` checks what kopf does not: the rights to what we watch (at start, and again while
missing), the reconciler and election threads, and the Task CRD's identity (a recreated
CRD restarts the watches, as does a check that passes while one of ours has stopped).

kopf (Pods, the CRD) and our `Reflector`s (Tasks, Leases) restart a failing watch by
themselves and say so only in their logs: `WatchHealth` listens to those logs. A failed API
request (retried, logged each time) makes the operator unready until `quiet_s` pass without
another one; a resource kopf refuses to watch at all (no permission, no CRD) keeps it
unready until an event of any watched kind arrives afterwards, and a Reflector stopped by
such an error until the watches restart. An idle operator with healthy watches stays ready:
no event is needed for that.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from tasklease.api import errors, models
from tasklease.kube import CRDS, JSON, LEASES, PODS, TASKS, Kube
from tasklease.kube.watching import Reflector
from tasklease.operator.reconciler import Reconciler

# kopf's API client logs each failed request here; its observer logs the resources it cannot watch.
REQUEST_LOGGERS = ("kopf._cogs.clients",)
WATCH_LOGGERS = ("kopf._core.reactor.observation",)
# Our Reflectors log each failed list or watch here ("watch of tasks interrupted ...").
REFLECTOR_LOGGER = "tasklease.kube.watching"
QUIET_S = 30.0
log = logging.getLogger("tasklease.operator")
CRD_NAME = f"{models.PLURAL}.{models.GROUP}"


class WatchHealth:
    def __init__(self, *, quiet_s: float = QUIET_S, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.quiet_s = quiet_s
        self.monotonic = monotonic
        self._lock = threading.Lock()
        self._failed_at: float | None = None
        self._failure = ""
        self._unwatched = ""
        self._reflectors: list[Reflector] = []
        self._optional: list[Reflector] = []

    def track(self, reflectors: list[Reflector], optional: list[Reflector] | None = None) -> None:
        """The Reflectors now running (they replace the ones before a restart). `optional`: of
        what an install may lack (the TaskQueue CRD): stopped, they are no reason to be unready,
        but the watches restart once what they watch is served (`Health.check`)."""
        with self._lock:
            self._reflectors = list(reflectors)
            self._optional = list(optional or [])

    def stopped_optional(self) -> list[Reflector]:
        with self._lock:
            return [r for r in self._optional if r.stopped and r.error is not None]

    def stopped(self) -> list[Reflector]:
        """Our watches that an error stopped for good (no rights, no CRD): only a restart brings them back."""
        with self._lock:
            return [r for r in self._reflectors if r.stopped and r.error is not None]

    def synced(self) -> bool:
        """Every one of our watches has listed what it watches once."""
        with self._lock:
            return all(r.synced.is_set() for r in self._reflectors)

    def event(self) -> None:
        """A watch event arrived: the watches work."""
        with self._lock:
            self._unwatched = ""

    def request_failed(self, message: str) -> None:
        with self._lock:
            self._failed_at, self._failure = self.monotonic(), message

    def cannot_watch(self, message: str) -> None:
        with self._lock:
            self._unwatched = message

    def reset(self) -> None:
        """The watches were restarted: nothing is known about them yet."""
        with self._lock:
            self._failed_at, self._failure, self._unwatched = None, "", ""

    def problem(self) -> str | None:
        """Why the watches are not healthy now; None when they are."""
        stopped = self.stopped()
        if stopped:
            return f"cannot watch {stopped[0].resource.plural}: {stopped[0].error}"
        with self._lock:
            if self._unwatched:
                return self._unwatched
            if self._failed_at is not None and self.monotonic() - self._failed_at < self.quiet_s:
                return self._failure
            return None

    def attach(self) -> None:
        """Listen to kopf's and our Reflectors' loggers (warnings and errors only)."""
        for names, record in ((REQUEST_LOGGERS, self.request_failed), (WATCH_LOGGERS, self.cannot_watch)):
            for name in names:
                logging.getLogger(name).addHandler(_Handler(record))
        # Not the Reflector's "skipping ..." of one unreadable object: that is no watch failure.
        logging.getLogger(REFLECTOR_LOGGER).addHandler(_Handler(self.request_failed, prefix="watch of "))


class _Handler(logging.Handler):
    def __init__(self, record: Callable[[str], None], prefix: str = "") -> None:
        super().__init__(level=logging.WARNING)
        self._record = record
        self._prefix = prefix

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(self._prefix):
            self._record(message.splitlines()[0][:300])


class Health:
    """Readiness and liveness beyond kopf's own start. Requests only at start and, while
    something is wrong, every `interval_s` until it is fixed."""

    def __init__(self, kube: Kube, reconciler: Reconciler, *, namespaces: list[str] | None,
                 threads: list[threading.Thread], elector_alive: Callable[[], bool] | None,
                 watches: WatchHealth, interval_s: float = 10.0) -> None:
        self.kube = kube
        self.reconciler = reconciler
        self.namespaces = namespaces
        self.threads = threads
        self.elector_alive = elector_alive
        self.watches = watches
        self.interval_s = interval_s
        self.problem = ""  # why we are not ready, from the last check
        # Set by the controller while its watches run: start them over.
        self.restart_watches: Callable[[], object] = lambda: None
        self._crd_uid = ""

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(self.interval_s):
            if not self.problem and not self.watches.stopped() and not self.watches.stopped_optional():
                continue
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the health check must outlive its own bugs
                log.exception("health check failed")

    def on_crd(self, kind: str, obj: JSON) -> None:
        """A watch event of the Task CRD."""
        if kind == "DELETED":
            self.problem = f"the Task CRD ({models.PLURAL}.{models.GROUP}) was deleted"
            log.error("not ready: %s", self.problem)
            return
        if not _established(obj):
            # kopf finds what it watches when it starts: restarted before the new CRD is
            # served, it would never watch Tasks. The CRD's Established event comes next.
            return
        uid = obj["metadata"]["uid"]
        if self._crd_uid and uid != self._crd_uid:
            self.problem = ""
            self.restart_watches()
        self._crd_uid = uid

    def check(self) -> None:
        """Our rights to what we watch, and the CRD's identity."""
        problem = ""
        try:
            crd = self.kube.get(CRDS, CRD_NAME, timeout=10)
            self.on_crd("ADDED", crd)
            scopes: list[str | None] = [*self.namespaces] if self.namespaces else [None]
            for ns in scopes:
                for res in (TASKS, LEASES, PODS):
                    self.kube.list(res, namespace=ns, all_namespaces=ns is None, limit=1, timeout=10)
        except errors.NotFound:
            problem = f"the Task CRD ({models.PLURAL}.{models.GROUP}) is not installed"
        except (errors.Forbidden, errors.CRDMissing) as exc:
            problem = f"{type(exc).__name__}: {exc}"
        except errors.TaskleaseError as exc:
            problem = f"the API server does not answer: {exc}"
        if problem and problem != self.problem:
            log.error("not ready: %s", problem)
        self.problem = problem
        stopped = self.watches.stopped() or [r for r in self.watches.stopped_optional() if self._served(r)]
        if not problem and stopped:
            # What stopped them (no CRD, no rights) is fixed now.
            log.warning("restarting the watches: the watch of %s had stopped", stopped[0].resource.plural)
            self.restart_watches()

    def _served(self, r: Reflector) -> bool:
        """What `r` watches can be listed now (its CRD is back, say)."""
        try:
            self.kube.list(r.resource, namespace=r.namespace, all_namespaces=r.namespace is None, limit=1,
                           label_selector=r.label_selector, timeout=10)
            return True
        except errors.TaskleaseError:
            return False

    def not_ready(self) -> str:
        watching = self.watches.problem()
        return self.problem or self.reconciler.problem or self.dead() or (f"watch failing: {watching}" if watching
                                                                          else "")

    def dead(self) -> str:
        """Why the process should be restarted: a thread it cannot live without has died."""
        gone = [t.name for t in self.threads if not t.is_alive()]
        if self.elector_alive is not None and not self.elector_alive():
            gone.append("leader-election")
        return f"thread(s) died: {', '.join(gone)}" if gone else ""


def _established(crd: JSON) -> bool:
    """True once the API server serves the CRD's resource (its Established condition)."""
    conditions = (crd.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)

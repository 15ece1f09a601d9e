"""Watch health for /readyz: kopf restarts a failing watch by itself and says so only in its log.

`WatchHealth` listens to that log. A failed API request (kopf retries it, logging each
failure) makes the operator unready until `quiet_s` pass without another one; a resource
kopf refuses to watch at all (no permission, no CRD) keeps it unready until an event of
any watched kind arrives afterwards. An idle operator with healthy watches stays ready: no
event is needed for that.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

# kopf's API client logs each failed request here; its observer logs the resources it cannot watch.
REQUEST_LOGGERS = ("kopf._cogs.clients",)
WATCH_LOGGERS = ("kopf._core.reactor.observation",)
QUIET_S = 30.0


class WatchHealth:
    def __init__(self, *, quiet_s: float = QUIET_S, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.quiet_s = quiet_s
        self.monotonic = monotonic
        self._lock = threading.Lock()
        self._failed_at: float | None = None
        self._failure = ""
        self._unwatched = ""

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

    def problem(self) -> str | None:
        """Why the watches are not healthy now; None when they are."""
        with self._lock:
            if self._unwatched:
                return self._unwatched
            if self._failed_at is not None and self.monotonic() - self._failed_at < self.quiet_s:
                return self._failure
            return None

    def attach(self) -> None:
        """Listen to kopf's loggers (warnings and errors only)."""
        for names, record in ((REQUEST_LOGGERS, self.request_failed), (WATCH_LOGGERS, self.cannot_watch)):
            for name in names:
                logging.getLogger(name).addHandler(_Handler(record))


class _Handler(logging.Handler):
    def __init__(self, record: Callable[[str], None]) -> None:
        super().__init__(level=logging.WARNING)
        self._record = record

    def emit(self, record: logging.LogRecord) -> None:
        self._record(record.getMessage().splitlines()[0][:300])

"""`tasklease top`: a live terminal view of the queues, refreshed from two watches.

Per (namespace, queue): its controls (a TaskQueue's pause, maxRunning and claim rate),
pending, running, backing off, succeeded, failed and dead-lettered counts, claims and
completions per second, the oldest pending task's age, the slowest running task, and the
holders. The state of each task comes from its Lease when it has one
(the truth, even while no operator runs), else from the Task's projected status.

`summarize` is pure (tested without a terminal); `Top` keeps the watches (TaskQueues
too, when their CRD is installed) (all namespaces
with -A); `run` draws
with curses until `q` or Ctrl-C. `--once` prints one snapshot for scripts.
"""

from __future__ import annotations

import collections
import curses
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime

from pydantic import ValidationError

from tasklease.api import errors, models, timestamps
from tasklease.api.queues import TaskQueueSpec
from tasklease.cli.output import duration, format_rows
from tasklease.kube import JSON, LEASES, TASKQUEUES, TASKS, Kube
from tasklease.kube.watching import Reflector
from tasklease.protocol import CLOSED, HELD, LeaseRecord, record

RATE_WINDOW_S = 10.0
_REDRAW_S = 1.0
_START_POLL_S = 0.05  # how often `Top.start` looks for a watch's failure while it waits for its list


@dataclass
class QueueRow:
    namespace: str
    queue: str
    pending: int = 0
    running: int = 0
    backing_off: int = 0
    succeeded: int = 0
    failed: int = 0
    dead_letters: int = 0
    claims_per_s: float = 0.0
    completions_per_s: float = 0.0
    oldest_pending_s: float | None = None
    slowest: tuple[str, float] | None = None  # (task, seconds running)
    holders: set[str] = field(default_factory=set)
    controls: TaskQueueSpec | None = None  # its TaskQueue's spec, if it has one


def describe_controls(spec: TaskQueueSpec | None) -> str:
    """`paused max=3 rate=2/s`; "-" without a TaskQueue or controls."""
    if spec is None:
        return "-"
    parts = ["paused"] if spec.paused else []
    if spec.max_running is not None:
        parts.append(f"max={spec.max_running}")
    if spec.claims_per_second is not None:
        parts.append(f"rate={spec.claims_per_second:g}/s")
    return " ".join(parts) or "-"


def state_of(task: JSON, rec: LeaseRecord | None, now: datetime) -> str:
    """Pending, BackingOff, Running, Succeeded, Failed or DeadLettered."""
    status = task.get("status") or {}
    own = rec is not None and rec.owner_uid == task["metadata"]["uid"]
    if own and rec is not None and rec.state == CLOSED:
        return "DeadLettered" if rec.reason == "DeadLettered" else rec.outcome
    if own and rec is not None and rec.state == HELD:
        return "Running"
    phase = status.get("phase") or ""
    if phase in models.TERMINAL_PHASES:
        return "DeadLettered" if status.get("reason") == "DeadLettered" else str(phase)
    waits = [t for t in (rec.not_before if own and rec is not None else None,
                         timestamps.parse_time((task.get("spec") or {}).get("notBefore"))) if t is not None]
    return "BackingOff" if any(t > now for t in waits) else "Pending"


def summarize(tasks: Iterable[JSON], leases: dict[tuple[str, str], LeaseRecord], now: datetime, *,
              claims: Iterable[tuple[str, str]] = (), completions: Iterable[tuple[str, str]] = (),
              window_s: float = RATE_WINDOW_S,
              controls: dict[tuple[str, str], TaskQueueSpec] | None = None) -> list[QueueRow]:
    """One row per (namespace, queue). `claims`/`completions`: the (namespace, queue) of each
    one seen in the last `window_s` seconds; `controls`: the TaskQueues' specs (a queue with
    one has a row even without tasks)."""
    rows: dict[tuple[str, str], QueueRow] = {}
    for key, spec in (controls or {}).items():
        rows[key] = QueueRow(*key, controls=spec)
    for task in tasks:
        meta = task["metadata"]
        key = (meta["namespace"], (task.get("spec") or {}).get("queue", ""))
        row = rows.setdefault(key, QueueRow(*key))
        rec = leases.get((meta["namespace"], meta["name"]))
        state = state_of(task, rec, now)
        if state in ("Pending", "BackingOff"):
            row.pending += 1
            row.backing_off += state == "BackingOff"
            age = (now - (timestamps.parse_time(meta.get("creationTimestamp")) or now)).total_seconds()
            row.oldest_pending_s = max(row.oldest_pending_s or 0.0, age)
        elif state == "Running" and rec is not None:
            row.running += 1
            row.holders.add(rec.holder_pod)
            ran = (now - (rec.acquired_at or now)).total_seconds()
            if row.slowest is None or ran > row.slowest[1]:
                row.slowest = (meta["name"], ran)
        elif state == "Succeeded":
            row.succeeded += 1
        elif state in ("Failed", "DeadLettered"):
            row.failed += 1
            row.dead_letters += state == "DeadLettered"
    for events, attr in ((claims, "claims_per_s"), (completions, "completions_per_s")):
        for key, count in collections.Counter(events).items():
            if key in rows:
                setattr(rows[key], attr, count / window_s)
    return [rows[k] for k in sorted(rows)]


HEADER = ["NAMESPACE", "QUEUE", "CONTROLS", "PENDING", "RUNNING", "BACKOFF", "SUCCEEDED", "FAILED", "DEAD", "CLAIMS/S",
          "DONE/S", "OLDEST-PENDING", "SLOWEST-RUNNING", "HOLDERS"]


def render(rows: list[QueueRow], *, title: str) -> str:
    lines = [[r.namespace, r.queue, describe_controls(r.controls), str(r.pending), str(r.running),
              str(r.backing_off), str(r.succeeded),
              str(r.failed), str(r.dead_letters), f"{r.claims_per_s:.1f}", f"{r.completions_per_s:.1f}",
              duration(r.oldest_pending_s) if r.oldest_pending_s is not None else "-",
              f"{r.slowest[0]} ({duration(r.slowest[1])})" if r.slowest else "-",
              ",".join(sorted(r.holders)) or "-"] for r in rows]
    table = format_rows([HEADER, *lines]) if lines else "no tasks"
    return f"{title}\n\n{table}\n"


class Top:
    """The two watches and the claim/completion events of the last RATE_WINDOW_S seconds."""

    def __init__(self, kube: Kube, *, namespace: str | None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.kube = kube
        self.namespace = namespace  # None: all namespaces
        self.monotonic = monotonic
        self.changed = threading.Event()
        self._lock = threading.Lock()
        self._tasks: dict[tuple[str, str], JSON] = {}
        self._leases: dict[tuple[str, str], LeaseRecord] = {}
        self._controls: dict[tuple[str, str], TaskQueueSpec] = {}
        self._watches = [Reflector(kube, TASKS, namespace=namespace, listener=self._on_task, keep_objects=False),
                         Reflector(kube, LEASES, namespace=namespace, listener=self._on_lease, keep_objects=False,
                                   label_selector=record.MANAGED_SELECTOR),
                         Reflector(kube, TASKQUEUES, namespace=namespace, listener=self._on_queue, keep_objects=False)]
        self._claims: collections.deque[tuple[float, tuple[str, str]]] = collections.deque()
        self._completions: collections.deque[tuple[float, tuple[str, str]]] = collections.deque()

    def start(self, timeout_s: float = 30.0, *, one_shot: bool = False) -> None:
        """Until every watch has listed. A watch stopped for good ends the wait; with `one_shot`
        (`--once`), so does its first failure, as it ends a single request: its retries would
        keep a script waiting for the whole `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        for watch in self._watches:
            watch.start()
        for watch in self._watches:
            while not watch.synced.wait(_START_POLL_S):
                failed = watch.error is not None and (one_shot or watch.stopped)
                if not failed and time.monotonic() < deadline:
                    continue
                if watch.resource == TASKQUEUES and isinstance(watch.error, errors.CRDMissing):
                    break  # an install without TaskQueues: queues without controls
                self.stop()
                if isinstance(watch.error, errors.TaskleaseError):
                    raise watch.error
                raise errors.Unreachable(f"the watch of {watch.resource.plural} did not start: "
                                         f"{watch.error or f'no answer in {timeout_s:.0f}s'}")

    def stop(self) -> None:
        for watch in self._watches:
            watch.stop()

    def rows(self) -> list[QueueRow]:
        cutoff = self.monotonic() - RATE_WINDOW_S
        with self._lock:
            for events in (self._claims, self._completions):
                while events and events[0][0] < cutoff:
                    events.popleft()
            return summarize(list(self._tasks.values()), dict(self._leases), timestamps.now_utc(),
                             claims=[k for _, k in self._claims], completions=[k for _, k in self._completions],
                             controls=dict(self._controls))

    def _on_queue(self, kind: str, obj: JSON) -> None:
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        try:
            spec = TaskQueueSpec.model_validate(obj.get("spec") or {})
        except ValidationError:  # refused by the CRD's schema; an older CRD may let it through
            spec = TaskQueueSpec()
        with self._lock:
            if kind == "DELETED":
                self._controls.pop(key, None)
            else:
                self._controls[key] = spec
        self.changed.set()

    def _on_task(self, kind: str, obj: JSON) -> None:
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        with self._lock:
            if kind == "DELETED":
                self._tasks.pop(key, None)
            else:
                self._tasks[key] = obj
        self.changed.set()

    def _on_lease(self, kind: str, obj: JSON) -> None:
        rec = record.decode(obj)
        key = (rec.namespace, rec.name)
        with self._lock:
            before = self._leases.get(key)
            if kind == "DELETED":
                self._leases.pop(key, None)
            else:
                self._leases[key] = rec
            if self._watches[1].synced.is_set() and kind != "DELETED":  # the first list is no news
                now, where = self.monotonic(), (rec.namespace, rec.queue)
                if rec.state == HELD and (before is None or rec.epoch > before.epoch):
                    self._claims.append((now, where))
                if rec.state == CLOSED and (before is None or before.state != CLOSED):
                    self._completions.append((now, where))
        self.changed.set()


def run(kube: Kube, *, namespace: str | None, once: bool) -> int:
    if not once and not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise errors.BadArguments("the live view needs a terminal: use `tasklease top --once` in scripts and pipes")
    if once and not logging.getLogger().isEnabledFor(logging.DEBUG):
        # Its one line says why a watch stopped; the watch's own report of it is for -v.
        logging.getLogger(Reflector.__module__).setLevel(logging.CRITICAL)
    top = Top(kube, namespace=namespace)
    top.start(one_shot=once)
    title = f"tasklease top - {namespace or 'all namespaces'}"
    try:
        if once:
            print(render(top.rows(), title=title), end="")
            return 0
        # ncurses prefers $COLUMNS/$LINES to the terminal's size; a stale export (shells and
        # test runners set them) would cut the view and ignore resizes.
        for name in ("COLUMNS", "LINES"):
            os.environ.pop(name, None)
        try:
            curses.wrapper(lambda screen: _draw_loop(screen, top, title))
        except curses.error as exc:  # $TERM unset, or a terminal ncurses does not know
            raise errors.BadArguments(f"cannot draw on this terminal ({exc}): use `tasklease top --once`") from None
        return 0
    finally:
        top.stop()


def _draw_loop(screen: curses.window, top: Top, title: str) -> None:
    curses.curs_set(0)
    screen.timeout(int(_REDRAW_S * 1000))
    while True:
        top.changed.clear()
        text = render(top.rows(), title=f"{title}   {time.strftime('%H:%M:%S')}   (q to quit)")
        screen.erase()
        height, width = screen.getmaxyx()
        for y, line in enumerate(text.splitlines()[:height - 1]):
            screen.addnstr(y, 0, line, width - 1)
        screen.refresh()
        key = screen.getch()  # waits at most _REDRAW_S: rates and ages move even without events
        if key in (ord("q"), ord("Q"), 27):
            return
        if key == curses.KEY_RESIZE:
            curses.update_lines_cols()

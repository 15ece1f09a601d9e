"""`tasklease run`: flock for a cluster. Claim a task, run a command for it, report the outcome.

The command gets TASKLEASE_TASK, TASKLEASE_NAMESPACE, TASKLEASE_EPOCH, TASKLEASE_HOLDER and
the payload as JSON three ways: on stdin, in the file named by TASKLEASE_PAYLOAD_FILE (when a
temporary directory is writable), and in TASKLEASE_PAYLOAD when it is small enough for the
environment (up to 64 KiB). While it
runs the lease is renewed; the moment ownership is lost the command gets SIGTERM, then
SIGKILL after a grace period. Exit 0 completes the task with the tail of its stdout as the
result; any other exit fails the attempt (retried with backoff until maxAttempts). A command
still running after the timeout (--timeout, else the Task's attemptTimeoutSeconds) is
stopped the same way, and its attempt fails with reason AttemptTimedOut.

With --loop one bad task (a lost lease, a refused write) does not stop the loop, and an
unreachable API server is retried with capped backoff, at start too; only permanent errors
(no rights, no CRD) end it. A command that cannot be started is no task's fault: it is
looked for before the first claim, and if it cannot be started all the same, its task is
released (not failed) and `run` ends (exit 2), since it would start for no other task
either. With --concurrency N, N loops run side by side.

SIGTERM or SIGINT stops it: no more claims, and the commands running get SIGTERM (SIGKILL
after the grace period) and their tasks are released. With --drain the commands running are
left to finish within the grace period instead (their outcome reported as usual); those
still running then are stopped and released; the exit code is 0. `tasklease run` is the
program's entry point: these handlers are its own.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import TextIO

from tasklease.api import errors, models
from tasklease.api.retry import Backoff, transient
from tasklease.agent.sdk import Agent, ClaimedTask

log = logging.getLogger(__name__)

_DRAIN_S = 2.0
# Linux refuses a single environment string over 128 KiB (E2BIG); stay well below.
MAX_ENV_PAYLOAD = 64 * 1024
# A loop is a thread and a command's process: far more than a pod runs well, and a typo's
# number of them would take the machine's memory before the first claim.
MAX_CONCURRENCY = 1000


class Runner:
    def __init__(self, agent: Agent, *, queue: str, argv: Sequence[str], grace_s: float = 10.0,
                 concurrency: int = 1, drain: bool = False, timeout_s: float | None = None) -> None:
        if not 1 <= concurrency <= MAX_CONCURRENCY:
            raise errors.Invalid(f"--concurrency must be 1 to {MAX_CONCURRENCY}, not {concurrency}")
        self.agent = agent
        self.queue = queue
        self.argv = list(argv)
        self.grace_s = grace_s
        self.concurrency = concurrency
        self.drain = drain
        self.timeout_s = timeout_s  # None: the Task's attemptTimeoutSeconds, if it has one
        self.stopping = threading.Event()
        self._drain_over = threading.Event()  # the grace of a drain ran out (set at once without --drain)
        self._children: set[subprocess.Popen[bytes]] = set()
        self._child_lock = threading.Lock()

    def run(self, *, loop: bool, wait_s: float | None) -> int:
        """One task (or, with `loop`, one after another until stopped or idle for `wait_s`;
        `concurrency` loops side by side, the exit code the first one's)."""
        if not _executable(self.argv[0]):
            raise errors.BadArguments(f"cannot start {self.argv[0]}: no such executable file (nothing claimed)")
        self._install_signal_handlers()
        if self.concurrency == 1 or not loop:
            return self._run(loop=loop, wait_s=wait_s)
        codes: list[int] = []
        others = [threading.Thread(target=lambda: codes.append(self._run(loop=True, wait_s=wait_s)),
                                   name=f"run-{i}", daemon=True) for i in range(1, self.concurrency)]
        for thread in others:
            thread.start()
        code = self._run(loop=True, wait_s=wait_s)
        for thread in others:
            thread.join()
        return code

    def stop(self) -> None:
        """Claim no more. Without --drain, stop the commands running now; with it, after the grace."""
        self.stopping.set()
        if not self.drain:
            self._drain_over.set()
            self._terminate_children()
            return
        log.info("draining: no more claims; %.0fs for the commands running", self.grace_s)

        def over() -> None:
            self._drain_over.set()
            self._terminate_children()
        timer = threading.Timer(self.grace_s, over)
        timer.daemon = True
        timer.start()

    def _run(self, *, loop: bool, wait_s: float | None) -> int:
        backoff = Backoff(base_s=0.5, cap_s=30.0)
        while not self._started(loop):
            if self.stopping.wait(backoff.next()):
                return errors.RUN_STOPPED
        backoff.reset()
        code = 0
        while not self.stopping.is_set():
            try:
                task = self.agent.claim(self.queue, timeout=wait_s if wait_s is not None else (None if loop else 0),
                                        interrupt=False, stop=self.stopping)
            except errors.NothingToClaim:
                if self.stopping.is_set():
                    break
                if loop:
                    return code
                raise
            except errors.TaskleaseError as exc:
                if not (loop and transient(exc)):
                    raise
                delay = backoff.next()
                log.warning("claiming from %s failed (%s); retrying in %.1fs", self.queue, exc, delay)
                self.stopping.wait(delay)
                continue
            backoff.reset()
            try:
                code = self._run_one(task)
            except (errors.LostLease, errors.Invalid, errors.Unreachable, errors.ServerError) as exc:
                if not loop:
                    raise
                # This attempt is over (ended, failed, or it will expire); the next task is
                # another one: keep going.
                log.warning("%s", exc)
                code = exc.exit_code
            if not loop:
                return code
        return 0 if self.drain else errors.RUN_STOPPED

    def _started(self, loop: bool) -> bool:
        """The agent's start (releasing an older instance's leases); in --loop an unreachable
        API server is waited out rather than fatal."""
        try:
            self.agent.start()
            return True
        except errors.TaskleaseError as exc:
            if not (loop and transient(exc)):
                raise
            log.warning("starting the agent failed (%s); retrying", exc)
            return False

    def _run_one(self, task: ClaimedTask) -> int:
        payload = json.dumps(task.payload, separators=(",", ":"))
        with _payload_file(payload, task.name) as path:
            env = {**os.environ, "TASKLEASE_TASK": task.name, "TASKLEASE_NAMESPACE": task.namespace,
                   "TASKLEASE_EPOCH": str(task.epoch), "TASKLEASE_HOLDER": task.holder}
            env.pop("TASKLEASE_PAYLOAD_FILE", None)
            if path is not None:
                env["TASKLEASE_PAYLOAD_FILE"] = path
            if len(payload) <= MAX_ENV_PAYLOAD:
                env["TASKLEASE_PAYLOAD"] = payload
            else:
                env.pop("TASKLEASE_PAYLOAD", None)
            limit = self.timeout_s if self.timeout_s is not None else task.held.spec.attempt_timeout_seconds
            code, tail, err_tail, timed_out = self._execute(task, env, payload.encode(), limit)
        if task.lost.is_set():
            raise errors.LostLease(f"lost {task.namespace}/{task.name} (attempt {task.epoch}): {task.lost_reason}; "
                                   f"the command was stopped")
        if self._drain_over.is_set():  # stopped (a drain: its grace ran out): the command did not finish
            task.release(f"agent {task.holder} was stopped")
            log.info("stopped: released %s/%s (attempt %d)", task.namespace, task.name, task.epoch)
            return 0 if self.drain else errors.RUN_STOPPED
        if timed_out:
            task.fail(failure_message(f"{models.ATTEMPT_TIMED_OUT}: {self.argv[0]} ran past its timeout of "
                                      f"{limit:g}s and was stopped", err_tail.text()), retryable=True)
            log.warning("%s/%s attempt %d timed out after %gs", task.namespace, task.name, task.epoch, limit)
            return errors.RUN_COMMAND_FAILED
        if code == 0:
            task.complete(tail.text())
            log.info("completed %s/%s (attempt %d)", task.namespace, task.name, task.epoch)
            return 0
        task.fail(failure_message(f"{self.argv[0]} exited with code {code}", err_tail.text()), retryable=True)
        log.warning("%s/%s attempt %d failed: exit code %d", task.namespace, task.name, task.epoch, code)
        return errors.RUN_COMMAND_FAILED

    def _execute(self, task: ClaimedTask, env: dict[str, str], stdin: bytes,
                 limit_s: float | None) -> tuple[int, _Tail, _Tail, bool]:
        """Check ownership, register the kill on loss, then spawn: a loss at any moment stops it,
        and so does `limit_s` running out (then the last value is True)."""
        log.info("running %s for %s/%s (attempt %d)", self.argv[0], task.namespace, task.name, task.epoch)
        spawned: list[subprocess.Popen[bytes]] = []

        def stop_command(_: ClaimedTask) -> None:
            for c in spawned:
                self._terminate(c)
        task.on_lost.append(stop_command)
        task.check()
        try:
            child = subprocess.Popen(self.argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True)
        except OSError as exc:
            task.release(f"cannot start {self.argv[0]}: {exc.strerror or exc}")
            self.stopping.set()  # the other loops too: the command starts for no task
            raise errors.BadArguments(f"cannot start {self.argv[0]}: {exc.strerror or exc} "
                                      f"({task.namespace}/{task.name} released)") from None
        spawned.append(child)
        with self._child_lock:
            self._children.add(child)
        if task.lost.is_set() or self._drain_over.is_set():
            self._terminate(child)  # lost (or stopped) while it was being spawned
        tail = _Tail(models.MAX_RESULT_BYTES, sink=sys.stdout)
        reader = threading.Thread(target=tail.pump, args=(child.stdout,), daemon=True)
        reader.start()
        # The end of stderr explains a failure: kept for lastError and the attempt's history.
        err_tail = _Tail(models.MAX_ERROR_CHARS, sink=sys.stderr)
        err_reader = threading.Thread(target=err_tail.pump, args=(child.stderr,), daemon=True)
        err_reader.start()
        # From a thread: a command that does not read a large payload must not block us.
        threading.Thread(target=_feed, args=(child, stdin), daemon=True).start()
        try:
            code = child.wait(limit_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            self._terminate(child)
            code = child.wait()
        for t, r in ((tail, reader), (err_tail, err_reader)):
            r.join(_DRAIN_S)
            if r.is_alive():
                t.echo = False  # maybe our own stdout is slow: keep reading, stop echoing
                r.join(_DRAIN_S)
        if reader.is_alive() or err_reader.is_alive():
            # Something the command started in the background still holds its output:
            # the command is over, and so is its process group.
            _signal_group(child, signal.SIGTERM)
            reader.join(_DRAIN_S)
            err_reader.join(_DRAIN_S)
        with self._child_lock:
            self._children.discard(child)
        return code, tail, err_tail, timed_out

    def _terminate_children(self) -> None:
        for child in list(self._children):  # no lock: called from a signal handler too
            self._terminate(child)

    def _terminate(self, child: subprocess.Popen[bytes]) -> None:
        """SIGTERM to the command's process group, SIGKILL after the grace period."""
        def kill() -> None:
            _signal_group(child, signal.SIGTERM)
            try:
                child.wait(self.grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(child, signal.SIGKILL)
        threading.Thread(target=kill, daemon=True).start()

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def stop(signum: int, frame: FrameType | None) -> None:
            self.stop()
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)


@contextlib.contextmanager
def _payload_file(payload: str, name: str) -> Iterator[str | None]:
    """The payload in a temporary file, for commands that want a path; None where no temporary
    directory is writable (a read-only root without an emptyDir at /tmp): stdin still has it."""
    try:
        # A task's name is up to 253 characters; a file's, 255 with the random part and suffix.
        handle = tempfile.NamedTemporaryFile("w", prefix=f"tasklease-{name[:200]}-", suffix=".json")
    except OSError as exc:
        log.warning("no payload file (%s): the payload is on stdin only", exc)
        yield None
        return
    with handle:
        handle.write(payload)
        handle.flush()
        yield handle.name


def failure_message(head: str, stderr_tail: str, limit: int = models.MAX_ERROR_CHARS) -> str:
    """`head`, then as much of the *end* of stderr as fits in `limit` characters."""
    tail = stderr_tail.strip()
    if not tail:
        return head[:limit]
    room = limit - len(head) - len(": ")
    if room <= 0:
        return head[:limit]
    return f"{head}: {tail[-room:]}"


class _Tail:
    """Echo a stream to `sink` (our stdout or stderr) and keep its last `limit` characters."""

    def __init__(self, limit: int, *, sink: TextIO) -> None:
        self.limit = limit
        self.sink = sink
        self.buffer = b""
        self.echo = True

    def pump(self, stream: object) -> None:
        for chunk in iter(lambda: stream.read1(65536), b""):  # type: ignore[attr-defined]
            self.buffer = (self.buffer + chunk)[-self.limit * 4:]
            if self.echo:
                try:
                    self.sink.buffer.write(chunk)
                    self.sink.buffer.flush()
                except OSError:  # our stdout went away (`| head`): keep draining the command's
                    self.echo = False

    def text(self) -> str:
        return self.buffer.decode(errors="replace")[-self.limit:].rstrip("\n")


def _executable(command: str) -> bool:
    """`command` names a file we may execute: a path, or a name on $PATH."""
    if os.sep in command:
        return os.path.isfile(command) and os.access(command, os.X_OK)
    return shutil.which(command) is not None


def _feed(child: subprocess.Popen[bytes], data: bytes) -> None:
    assert child.stdin is not None
    try:
        child.stdin.write(data)
        child.stdin.close()
    except (BrokenPipeError, OSError):
        pass  # the command does not read stdin: fine


def _signal_group(child: subprocess.Popen[bytes], signum: int) -> None:
    try:
        os.killpg(child.pid, signum)
    except ProcessLookupError:
        pass

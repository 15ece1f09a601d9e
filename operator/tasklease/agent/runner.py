"""`tasklease run`: flock for a cluster. Claim a task, run a command for it, report the outcome.

The command gets TASKLEASE_TASK, TASKLEASE_NAMESPACE, TASKLEASE_EPOCH, TASKLEASE_HOLDER and
TASKLEASE_PAYLOAD (the payload also arrives on stdin). While it runs the lease is renewed;
the moment ownership is lost the command gets SIGTERM, then SIGKILL after a grace period.
Exit 0 completes the task with the tail of its stdout as the result; any other exit fails
the attempt (retried with backoff until maxAttempts).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from types import FrameType
from typing import TextIO

from tasklease.api import errors, models
from tasklease.agent.sdk import Agent, ClaimedTask

log = logging.getLogger(__name__)

_DRAIN_S = 2.0


class Runner:
    def __init__(self, agent: Agent, *, queue: str, argv: Sequence[str], grace_s: float = 10.0) -> None:
        self.agent = agent
        self.queue = queue
        self.argv = list(argv)
        self.grace_s = grace_s
        self.stopping = threading.Event()
        self._child: subprocess.Popen[bytes] | None = None

    def run(self, *, loop: bool, wait_s: float | None) -> int:
        """One task (or, with `loop`, one after another until stopped or idle for `wait_s`)."""
        self._install_signal_handlers()
        self.agent.start()
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
            except (errors.Unreachable, errors.ServerError) as exc:
                if not loop:
                    raise
                log.warning("claiming from %s failed (%s); retrying", self.queue, exc)
                self.stopping.wait(1.0)
                continue
            try:
                code = self._run_one(task)
            except (errors.LostLease, errors.Unreachable, errors.ServerError) as exc:
                if not loop:
                    raise
                # This attempt is over (or will expire); the next task is another one: keep going.
                log.warning("%s", exc)
                code = exc.exit_code
            if not loop:
                return code
        return errors.RUN_STOPPED

    def _run_one(self, task: ClaimedTask) -> int:
        payload = json.dumps(task.payload, separators=(",", ":"))
        env = {**os.environ, "TASKLEASE_TASK": task.name, "TASKLEASE_NAMESPACE": task.namespace,
               "TASKLEASE_EPOCH": str(task.epoch), "TASKLEASE_HOLDER": task.holder, "TASKLEASE_PAYLOAD": payload}
        log.info("running %s for %s/%s (attempt %d)", self.argv[0], task.namespace, task.name, task.epoch)
        try:
            child = subprocess.Popen(self.argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True)
        except OSError as exc:
            task.fail(f"cannot start {self.argv[0]}: {exc}", retryable=False)
            raise errors.Invalid(f"cannot start {self.argv[0]}: {exc.strerror}") from None
        self._child = child
        task.on_lost.append(lambda _t: self._terminate(child))
        tail = _Tail(models.MAX_RESULT_BYTES, sink=sys.stdout)
        reader = threading.Thread(target=tail.pump, args=(child.stdout,), daemon=True)
        reader.start()
        # The end of stderr explains a failure: kept for lastError and the attempt's history.
        err_tail = _Tail(models.MAX_ERROR_CHARS, sink=sys.stderr)
        err_reader = threading.Thread(target=err_tail.pump, args=(child.stderr,), daemon=True)
        err_reader.start()
        try:
            assert child.stdin is not None
            child.stdin.write(payload.encode())
            child.stdin.close()
        except BrokenPipeError:
            pass  # the command does not read stdin: fine
        code = child.wait()
        for t, r in ((tail, reader), (err_tail, err_reader)):
            r.join(_DRAIN_S)
            if r.is_alive():
                t.echo = False  # maybe our own stdout is slow: keep reading, stop echoing
                r.join(_DRAIN_S)
        if reader.is_alive() or err_reader.is_alive():
            # Something the command started in the background still holds its stdout:
            # the command is over, and so is its process group.
            _signal_group(child, signal.SIGTERM)
            reader.join(_DRAIN_S)
        self._child = None
        if task.lost.is_set():
            raise errors.LostLease(f"lost {task.namespace}/{task.name} (attempt {task.epoch}): {task.lost_reason}; "
                                   f"the command was stopped")
        if self.stopping.is_set():
            task.release(f"agent {task.holder} was stopped")
            return errors.RUN_STOPPED
        if code == 0:
            task.complete(tail.text())
            log.info("completed %s/%s (attempt %d)", task.namespace, task.name, task.epoch)
            return 0
        task.fail(failure_message(f"{self.argv[0]} exited with code {code}", err_tail.text()), retryable=True)
        log.warning("%s/%s attempt %d failed: exit code %d", task.namespace, task.name, task.epoch, code)
        return errors.RUN_COMMAND_FAILED

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
            self.stopping.set()
            if self._child is not None:
                self._terminate(self._child)
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)


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


def _signal_group(child: subprocess.Popen[bytes], signum: int) -> None:
    try:
        os.killpg(child.pid, signum)
    except ProcessLookupError:
        pass

"""The agent's side reads: on kept threads while it is open, in the caller's thread once it is closed (pure)."""

from __future__ import annotations

import threading

import pytest

from tasklease.agent.beside import Beside

pytestmark = pytest.mark.unit


def test_calls_run_on_two_kept_threads_and_inline_after_shutdown() -> None:
    beside = Beside()
    names = {beside.submit(lambda: threading.current_thread().name).result() for _ in range(20)}
    assert names and all(n.startswith("tasklease-beside") for n in names) and len(names) <= 2
    # Both threads at once: nothing run beside waits for anything else run beside.
    both = threading.Barrier(2, timeout=5)
    assert [f.result(timeout=10) for f in [beside.submit(both.wait) for _ in range(2)]] in ([0, 1], [1, 0])
    beside.shutdown(wait=True)
    assert beside.submit(lambda: threading.current_thread().name).result() == threading.current_thread().name


def test_an_exception_is_raised_by_result_open_or_closed() -> None:
    beside = Beside()
    for _ in range(2):
        failed = beside.submit(int, "not a number")
        with pytest.raises(ValueError, match="not a number"):
            failed.result(timeout=10)
        beside.shutdown()

"""ClaimedTask's renewal logic without an API server: a stand-in Protocol that counts."""

from __future__ import annotations

import gc
from datetime import UTC, datetime
import logging
import signal
import threading
import time
from typing import Any

import pytest

from conftest import wait_for
from tasklease.agent.cancel import Followers, _QueueFollower
from tasklease.agent.claimed import ClaimedTask
from tasklease.api import errors, models
from tasklease.protocol import Held, LeaseRecord, TaskView


class CountingProtocol:
    """Answers renewals at once."""

    def __init__(self) -> None:
        self.renewals = 0

    def renew(self, held: Held, *, timeout: float = 30) -> Held:
        self.renewals += 1
        return held

    def complete(self, held: Held, result: str) -> Held:
        return held

    def release(self, held: Held, message: str) -> Held:
        return held


def _claim(protocol: Any) -> ClaimedTask:
    spec = models.TaskSpec(queue="q", lease_duration_seconds=5)
    rec = LeaseRecord(name="t", namespace="ns", queue="q", owner_uid="u", holder="p/1", epoch=1, duration_s=5)
    held = Held(namespace="ns", name="t", holder="p/1", epoch=1, spec=spec, uid="u", record=rec)
    return ClaimedTask(protocol, held, {})  # no followers: nothing to follow without a cluster


def _renewers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "renew-t"]


def test_a_claim_dropped_without_an_ending_stops_being_renewed() -> None:
    protocol = CountingProtocol()
    task = _claim(protocol)
    wait_for(lambda: protocol.renewals >= 1, timeout=10, message="a first renewal")
    del task
    gc.collect()
    wait_for(lambda: not _renewers(), timeout=10, message="the renew thread to end")


def test_a_claim_ended_before_its_first_renewal_never_starts_a_renew_thread(monkeypatch: Any) -> None:
    started: list[str] = []

    class Counted(threading.Thread):
        def start(self) -> None:
            started.append(self.name)
            super().start()
    monkeypatch.setattr(threading, "Thread", Counted)
    short, long = CountingProtocol(), CountingProtocol()
    _claim(short).complete("done at once")
    held = _claim(long)  # due after the first: once it is renewed, the first's turn has come and gone
    wait_for(lambda: long.renewals >= 1, timeout=10, message="the second claim's first renewal")
    assert short.renewals == 0 and started.count("renew-t") == 1
    held.complete("done")


def test_a_loss_sets_the_token_and_check_raises_but_nothing_is_raised_into_the_work() -> None:
    task = _claim(CountingProtocol())
    with task:
        task._lose("taken over")
        assert task.lost.is_set() and task.finished
        with pytest.raises(errors.LostLease, match="taken over"):
            task.check()
    # Left without an outcome after the loss: nothing to write, nothing raised.


def test_on_lost_callbacks_run_on_their_own_thread_and_one_that_raises_does_not_stop_the_others(
        caplog: pytest.LogCaptureFixture) -> None:
    task = _claim(CountingProtocol())
    ran: list[str] = []
    done = threading.Event()

    def broken(_: ClaimedTask) -> None:
        ran.append(threading.current_thread().name)
        raise RuntimeError("a broken callback")

    def fine(_: ClaimedTask) -> None:
        ran.append("fine")
        done.set()
    task.on_lost += [broken, fine]
    with caplog.at_level(logging.ERROR, logger="tasklease.agent.claimed"):
        task._lose("expired")
        assert done.wait(10)
    assert ran == ["lost-t", "fine"]
    assert "an on_lost callback of ns/t failed" in caplog.text


def test_interrupt_raises_lost_lease_into_busy_work_on_the_main_thread_only_inside_the_block() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    task = ClaimedTask(CountingProtocol(), _claim(CountingProtocol()).held, {}, interrupt=True)
    with pytest.raises(errors.LostLease, match="cancelled"), task:
        assert signal.getsignal(signal.SIGUSR1) != before
        threading.Timer(0.05, task._lose, args=("cancelled",)).start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # busy work that never checks
            sum(range(100))
    assert signal.getsignal(signal.SIGUSR1) == before


def test_a_loss_decided_as_the_block_ends_is_not_raised_later_and_the_handler_is_restored() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    for _ in range(50):  # the loss lands before, during or after the block's end
        task = ClaimedTask(CountingProtocol(), _claim(CountingProtocol()).held, {}, interrupt=True)
        timer = threading.Timer(0.001, task._lose, args=("lost at the end",))
        try:
            with task:
                timer.start()
        except errors.LostLease:
            pass  # lost inside the block: fine
        timer.join()
        sum(range(10_000))  # after the block: nothing may be raised here
        assert signal.getsignal(signal.SIGUSR1) == before


def test_interrupt_is_refused_off_the_main_thread() -> None:
    task = ClaimedTask(CountingProtocol(), _claim(CountingProtocol()).held, {}, interrupt=True)
    refused: list[BaseException] = []

    def work() -> None:
        try:
            with task:
                pass
        except errors.Invalid as exc:
            refused.append(exc)
    thread = threading.Thread(target=work)
    thread.start()
    thread.join(10)
    assert refused and "main thread only" in str(refused[0])


def test_a_claim_of_a_task_whose_cancel_was_seen_already_is_lost_at_once_not_an_error() -> None:
    followers = Followers(None)  # type: ignore[arg-type]  # no request is made: the cancel is known
    follower = _QueueFollower(None, ("ns", "q"), reflector=None, lock=followers._lock)  # type: ignore[arg-type]
    follower.ended["u"] = "task ns/t was cancelled"
    followers._own[("ns", "q")] = follower
    task = ClaimedTask(CountingProtocol(), _claim(CountingProtocol()).held, {}, followers=followers)
    assert task.lost.is_set() and task.lost_reason == "task ns/t was cancelled"
    with pytest.raises(errors.LostLease), task:
        pass


class _NoKube:
    namespace = "ns"

    def now(self) -> datetime:
        return datetime(2030, 1, 1, tzinfo=UTC)


def test_a_claim_that_cannot_be_taken_up_is_given_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Construction order cannot leak a claim: won, then failing to become a ClaimedTask, it is released."""
    from tasklease.agent import sdk
    released: list[str] = []

    class Recording(CountingProtocol):
        def release(self, held: Held, message: str) -> Held:
            released.append(message)
            return held

    def broken(*args: Any, **kwargs: Any) -> ClaimedTask:
        raise RuntimeError("could not start a thread")
    agent = sdk.Agent(_NoKube(), identity=sdk.Identity(pod="p", instance="1"))  # type: ignore[arg-type]
    agent.protocol = Recording()  # type: ignore[assignment]
    monkeypatch.setattr(sdk, "ClaimedTask", broken)
    held = _claim(CountingProtocol()).held
    view = TaskView(name="t", namespace="ns", uid="u", spec=held.spec, created="")
    with pytest.raises(RuntimeError):
        agent._claimed(view, held, interrupt=False)
    assert released == ["its agent could not take up the claim"]

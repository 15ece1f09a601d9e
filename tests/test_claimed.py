"""ClaimedTask's renewal logic without an API server: a stand-in Protocol that counts."""

from __future__ import annotations

import gc
import threading
from typing import Any

from conftest import wait_for
from tasklease.agent.sdk import ClaimedTask
from tasklease.api import models
from tasklease.protocol import Held, LeaseRecord


class CountingProtocol:
    """Answers renewals at once."""

    def __init__(self) -> None:
        self.renewals = 0

    def renew(self, held: Held, *, timeout: float = 30) -> Held:
        self.renewals += 1
        return held

    def complete(self, held: Held, result: str) -> Held:
        return held


def _claim(protocol: Any) -> ClaimedTask:
    spec = models.TaskSpec(queue="q", lease_duration_seconds=5)
    rec = LeaseRecord(name="t", namespace="ns", queue="q", owner_uid="u", holder="p/1", epoch=1, duration_s=5)
    held = Held(namespace="ns", name="t", holder="p/1", epoch=1, spec=spec, uid="u", record=rec)
    return ClaimedTask(protocol, held, {}, interrupt=False, follow=False)  # no cluster: nothing to follow


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

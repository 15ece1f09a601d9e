"""The one retry backoff: capped, exponential, jittered; permanent errors are told apart."""

from __future__ import annotations

import random

import pytest

from tasklease.api import errors
from tasklease.api.retry import Backoff, transient

pytestmark = pytest.mark.unit  # pure logic: `make unit` runs it, on every Python


def test_delays_double_up_to_the_cap_and_stay_in_the_upper_half() -> None:
    backoff = Backoff(base_s=1, cap_s=8, rng=random.Random(7))
    delays = [backoff.next() for _ in range(8)]
    ceilings = [1, 2, 4, 8, 8, 8, 8, 8]
    assert all(c / 2 <= d <= c for d, c in zip(delays, ceilings, strict=True)), delays
    assert len(set(delays)) == len(delays)  # jittered: no two equal


def test_reset_starts_over_from_the_base() -> None:
    backoff = Backoff(base_s=1, cap_s=60)
    for _ in range(10):
        backoff.next()
    backoff.reset()
    assert backoff.next() <= 1


def test_a_try_that_ran_healthy_before_failing_starts_the_delays_over() -> None:
    backoff = Backoff(base_s=1, cap_s=60, healthy_s=10, rng=random.Random(3))
    quick = [backoff.failed(ran_s=0.1) for _ in range(4)]  # one outage: each try fails at once
    assert all(d / 2 <= delay <= d for delay, d in zip(quick, [1, 2, 4, 8], strict=True)), quick
    assert backoff.failed(ran_s=9.9) >= 8  # not yet healthy: still the same outage
    assert backoff.failed(ran_s=10.0) <= 1  # streamed 10 s, then failed: a new outage
    assert Backoff(base_s=1, cap_s=60, failures=4).failed(ran_s=600) >= 8  # without healthy_s, only reset() does


def test_many_failures_do_not_overflow() -> None:
    backoff = Backoff(base_s=0.5, cap_s=30, failures=10_000)
    assert 15 <= backoff.next() <= 30


def test_a_bad_configuration_is_refused() -> None:
    with pytest.raises(ValueError):
        Backoff(base_s=0, cap_s=1)
    with pytest.raises(ValueError):
        Backoff(base_s=2, cap_s=1)


def test_only_network_and_server_errors_are_transient() -> None:
    assert transient(errors.Unreachable("x")) and transient(errors.ServerError("503"))
    for permanent in (errors.Forbidden("x"), errors.CRDMissing("x"), errors.Invalid("x"), errors.NotFound("x")):
        assert not transient(permanent)

"""Leader election against a real API server: failures are said, stepping down is complete."""

from __future__ import annotations

import logging
import threading

import pytest

from conftest import wait_for
from tasklease.kube import Kube
from tasklease.operator.leader import ElectionConfig, LeaderElector
from tasklease.protocol.election import ElectionLock

FAST = ElectionConfig(namespace="", lease_duration_s=3, renew_deadline_s=2, retry_period_s=0.2)


def _config(kube: Kube) -> ElectionConfig:
    return ElectionConfig(namespace=kube.namespace, lease_duration_s=FAST.lease_duration_s,
                          renew_deadline_s=FAST.renew_deadline_s, retry_period_s=FAST.retry_period_s)


def test_stop_hands_over_and_calls_on_stopped(kube: Kube) -> None:
    stopped = threading.Event()
    elector = LeaderElector(kube, _config(kube), identity="a", on_started=lambda: None, on_stopped=stopped.set)
    elector.start()
    assert elector.leading.wait(30)
    elector.stop()
    assert stopped.is_set() and not elector.leading.is_set()
    current = ElectionLock(kube, namespace=kube.namespace, name=_config(kube).name).read()
    assert current is not None and current.holder == ""  # handed over at once


def test_the_first_attempt_decides_the_role_leader_or_standby(kube: Kube) -> None:
    started = threading.Event()
    leader = LeaderElector(kube, _config(kube), identity="first", on_started=started.set, on_stopped=lambda: None)
    standby = LeaderElector(kube, _config(kube), identity="second", on_started=lambda: None,
                            on_stopped=lambda: None)
    assert not leader.decided.is_set()
    leader.start()
    try:
        assert leader.decided.wait(30)
        assert leader.leading.is_set() and started.is_set()  # on_started ran before the role was known
        standby.start()
        assert standby.decided.wait(30)
        assert not standby.leading.is_set()
    finally:
        standby.stop()
        leader.stop()


def test_a_failing_on_started_is_logged_and_the_lease_handed_over(
        kube: Kube, caplog: pytest.LogCaptureFixture) -> None:
    stopped = threading.Event()

    def broken() -> None:
        raise RuntimeError("cannot list leases")

    elector = LeaderElector(kube, _config(kube), identity="b", on_started=broken, on_stopped=stopped.set)
    with caplog.at_level(logging.ERROR, logger="tasklease.operator.leader"):
        elector.start()
        wait_for(lambda: stopped.is_set(), message="stepping down after on_started failed")
        assert elector.alive()  # the election thread itself survived, and campaigns on
        elector.stop()
    assert "could not start leading" in caplog.text and "cannot list leases" in caplog.text


def test_the_configuration_keeps_the_client_go_relations() -> None:
    with pytest.raises(ValueError):
        ElectionConfig(namespace="x", lease_duration_s=10, renew_deadline_s=10, retry_period_s=1)
    with pytest.raises(ValueError):
        ElectionConfig(namespace="x", lease_duration_s=15, renew_deadline_s=10, retry_period_s=9)
    ElectionConfig(namespace="x")  # the defaults hold


def test_a_leader_that_cannot_renew_steps_down_after_the_renew_deadline(
        cluster, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    import uuid

    from tasklease.kube import NAMESPACES

    name = f"lead-{uuid.uuid4().hex[:6]}"
    admin = cluster.kube()
    admin.create(NAMESPACES, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    kube = cluster.kube(name)
    stopped = threading.Event()
    elector = LeaderElector(kube, _config(kube), identity="c", on_started=lambda: None, on_stopped=stopped.set)
    with caplog.at_level(logging.WARNING, logger="tasklease.operator.leader"):
        elector.start()
        assert elector.leading.wait(30)
        admin.delete(NAMESPACES, name)  # its Lease goes, and no new one may be created there
        wait_for(lambda: stopped.is_set(), timeout=60, message="stepping down")
        assert not elector.leading.is_set()
        elector.stop()
    assert "lost leadership" in caplog.text

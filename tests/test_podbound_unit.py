"""Pod-bound leases, the pure parts: what the operator decides on an injected clock, how the
binding travels in the Lease, and where a Pod finds its own uid."""

from __future__ import annotations

import base64
import json
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from tasklease.agent.identity import own_pod_uid
from tasklease.operator.podbound import Act, Bindings, pod_state
from tasklease.protocol import record
from tasklease.protocol.rules import TaskView, claimed, ended
from fake_clock import Clock

pytestmark = pytest.mark.unit

UID = "0b8e6a52-8f53-4c0e-9f0a-3c1d2e4f5a6b"
NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
KEY = ("ns", "t")


def held(*, rv: str = "1", epoch: int = 1, pod_bound: str = UID, holder: str = "p/shell.1") -> record.LeaseRecord:
    return record.LeaseRecord(name="t", namespace="ns", queue="q", owner_uid="task-uid", holder=holder, epoch=epoch,
                              acquired_at=NOW, renewed_at=NOW, pod_bound=pod_bound, resource_version=rv)


def pod(*, uid: str = UID, phase: str = "Running", restarts: int = 0, running: bool = True,
        deleting: bool = False, name: str = "p") -> dict[str, Any]:
    state = {"running": {"startedAt": "2026-01-01T12:00:00Z"}} if running else {"terminated": {"exitCode": 1}}
    meta: dict[str, Any] = {"name": name, "namespace": "ns", "uid": uid}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T12:00:00Z"
    return {"metadata": meta, "status": {"phase": phase, "containerStatuses": [
        {"name": "work", "restartCount": restarts, "state": state}]}}


def bound(clock: Clock, duration_s: int | None = 9) -> Bindings:
    """A binding of `held()` to a running `pod()`, its Task's duration read."""
    b = Bindings(clock)
    assert b.lease(KEY, held())
    assert b.pod("ADDED", pod()) == [KEY]
    if duration_s is not None:
        b.read_task(KEY, duration_s)
    return b


def test_renews_a_third_of_the_tasks_duration_after_the_version_it_last_saw() -> None:
    clock = Clock()
    b = bound(clock)
    verdict = b.decide(KEY)
    assert verdict.act is Act.WAIT and verdict.at == 103.0
    clock.now = 103.0
    assert b.decide(KEY).act is Act.RENEW
    b.lease(KEY, held(rv="2"))  # the renewal (or any write) is a new version: the count starts again
    assert b.decide(KEY).at == 106.0
    b.lease(KEY, held(rv="2"))  # the same version again (a relist) keeps its first sighting
    assert b.decide(KEY).at == 106.0


def test_the_tasks_duration_is_read_before_any_renewal() -> None:
    b = bound(Clock(), duration_s=None)
    assert b.decide(KEY).act is Act.READ_TASK


def test_a_pod_it_cannot_see_gets_no_renewals() -> None:
    b = Bindings(Clock())
    b.lease(KEY, held())
    b.read_task(KEY, 9)
    verdict = b.decide(KEY)
    assert verdict.act is Act.WAIT and verdict.at is None


def test_a_restarted_container_expires_the_lease_at_once() -> None:
    b = bound(Clock())
    b.pod("MODIFIED", pod(restarts=1))
    verdict = b.decide(KEY)
    assert verdict.act is Act.EXPIRE and verdict.cause == "container-restarted"
    assert "container work restarted (restartCount 0 → 1)" in verdict.message


def test_a_stopped_container_expires_the_lease_before_it_restarts() -> None:
    b = bound(Clock())
    b.pod("MODIFIED", pod(running=False))
    assert b.decide(KEY).cause == "container-restarted"


def test_restarts_before_the_binding_was_seen_do_not_count() -> None:
    b = Bindings(Clock())
    assert b.pod("ADDED", pod(restarts=4)) == []  # nobody is bound to it yet, but it is remembered
    b.lease(KEY, held())
    b.read_task(KEY, 9)
    assert b.decide(KEY).act is Act.WAIT
    b.pod("MODIFIED", pod(restarts=5))
    assert b.decide(KEY).act is Act.EXPIRE


@pytest.mark.parametrize(("event", "obj", "says"), [
    ("DELETED", pod(), "its pod p was deleted"),
    ("MODIFIED", pod(phase="Failed", running=False), "terminated (Failed)"),
    ("MODIFIED", pod(phase="Succeeded", running=False), "terminated (Succeeded)"),
    ("ADDED", pod(uid="another-uid"), "a pod of that name with another uid runs"),
])
def test_a_pod_that_goes_expires_the_lease(event: str, obj: dict[str, Any], says: str) -> None:
    b = bound(Clock())
    assert b.pod(event, obj) == [KEY]
    verdict = b.decide(KEY)
    assert verdict.act is Act.EXPIRE and verdict.cause == "pod-gone" and says in verdict.message


def test_a_namesakes_deletion_is_not_the_bound_pods() -> None:
    clock = Clock()
    b = bound(clock)
    b.pod("DELETED", pod(uid="an-older-uid"))
    clock.now += 3
    assert b.decide(KEY).act is Act.RENEW


def test_a_pod_being_deleted_gets_no_more_renewals_but_keeps_its_lease() -> None:
    clock = Clock()
    b = bound(clock)
    b.pod("MODIFIED", pod(deleting=True))
    clock.now += 60
    verdict = b.decide(KEY)
    assert verdict.act is Act.WAIT and verdict.at is None


def test_an_ended_or_unbound_lease_is_forgotten_with_its_pod() -> None:
    b = bound(Clock())
    assert not b.lease(KEY, held(pod_bound=""))
    assert len(b) == 0 and b.decide(KEY).act is Act.WAIT
    assert b.pod("MODIFIED", pod()) == []  # no lease of it followed any more
    b = bound(Clock())
    assert not b.lease(KEY, None)
    assert len(b) == 0


def test_a_new_attempt_is_a_new_binding_judged_from_its_own_start() -> None:
    b = bound(Clock())
    b.pod("MODIFIED", pod(restarts=1))
    b.lease(KEY, held(epoch=2, rv="5"))  # claimed again from the same Pod, after the restart
    b.pod("MODIFIED", pod(restarts=1))
    b.read_task(KEY, 9)
    assert b.decide(KEY).act is Act.WAIT


def test_pod_state_reads_what_decides() -> None:
    state = pod_state(pod(restarts=2, deleting=True))
    assert state.uid == UID and state.phase == "Running" and state.deleting
    assert state.containers == {"work": (2, True)}
    assert pod_state({"metadata": {}}).containers == {}


# -- the binding in the Lease -----------------------------------------------------------------------


def test_the_binding_is_written_and_read_only_while_held() -> None:
    rec = held()
    lease = record.encode(rec)
    assert lease["metadata"]["annotations"][record.ANN_POD_BOUND] == UID
    assert record.decode(lease).pod_bound == UID
    freed = ended(rec, outcome="Released", now=NOW)
    assert record.ANN_POD_BOUND not in record.encode(freed)["metadata"]["annotations"]
    # A merge patch removes it when the attempt ends: the next holder starts unbound.
    assert record.encode_patch(freed)["metadata"]["annotations"][record.ANN_POD_BOUND] is None
    lease["metadata"]["annotations"][record.ANN_OUTCOME] = "Succeeded"
    assert record.decode(lease).pod_bound == ""


def test_a_new_claim_is_never_bound_by_a_leftover() -> None:
    task = {"metadata": {"name": "t", "namespace": "ns", "uid": "task-uid"}, "spec": {"queue": "q"}}
    leftover = replace(held(holder=""), pod_bound=UID)
    assert claimed(TaskView.of(task), leftover, "other/1", NOW).pod_bound == ""


# -- the Pod's own uid ----------------------------------------------------------------------------------


def _token(claims: dict[str, Any]) -> str:
    def part(obj: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).decode().rstrip("=")
    return f"{part({'alg': 'RS256'})}.{part(claims)}.signature"


def test_own_pod_uid_from_the_environment_then_the_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token = tmp_path / "token"
    token.write_text(_token({"kubernetes.io": {"namespace": "ns", "pod": {"name": "p", "uid": UID}}}))
    monkeypatch.delenv("POD_UID", raising=False)
    assert own_pod_uid(token) == UID
    monkeypatch.setenv("POD_UID", "from-the-downward-api")
    assert own_pod_uid(token) == "from-the-downward-api"
    monkeypatch.delenv("POD_UID")
    token.write_text(_token({"kubernetes.io": {"namespace": "ns"}}))  # a token bound to no Pod
    assert own_pod_uid(token) == ""
    token.write_text("not a token")
    assert own_pod_uid(token) == ""
    assert own_pod_uid(tmp_path / "missing") == ""

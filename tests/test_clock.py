"""One clock (issue 30): no decision rests on a writer's clock or a writer's chosen duration.

The pure parts on injected clocks and a fake Kube (milliseconds); then against the real API
server, with agents whose clocks are set 60 s off by libfaketime (Debian's `faketime`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import ssl
import time
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml
from conftest import Cluster, Operator, agent_pod_kubeconfig, make_task, tasklease_cmd, wait_for
from fake_kube import FakeKube

from tasklease.api import models
from tasklease.api.timestamps import format_time, now_utc, parse_time
from tasklease.kube import JSON, LEASES, TASKS, Kube
from tasklease.kube.servertime import ServerClock
from tasklease.operator import cleanup, projection
from tasklease.operator.reconciler import Reconciler
from tasklease.protocol import LeaseRecord, Protocol, TaskView, members, record
from tasklease.protocol.rules import attempts_used, claimed

pytestmark = pytest.mark.adversarial

T0 = datetime(2030, 1, 1, 12, 0, 0, tzinfo=UTC)


# -- the API server's time, from Date headers -------------------------------------------------


def _answer(server: ServerClock, *, local: datetime, skew_s: float, rtt_s: float = 0.02) -> None:
    """One request sent at `local`: the server (its clock `skew_s` ahead of ours) dates it half way."""
    stamped = local + timedelta(seconds=skew_s + rtt_s / 2)
    server.observe(format_datetime(stamped.replace(microsecond=0), usegmt=True), sent=local,
                   got=local + timedelta(seconds=rtt_s))


@pytest.mark.parametrize("skew_s", [-60.0, 60.0, 0.0])
def test_the_server_clock_is_bounded_from_date_headers_whatever_ours_says(skew_s: float) -> None:
    local = [T0]
    server = ServerClock(wall=lambda: local[0])
    assert server.earliest() == T0  # no answer yet: our own clock
    for step in range(12):  # answers at different fractions of a second narrow the bounds
        local[0] = T0 + timedelta(seconds=step * 1.37)
        _answer(server, local=local[0], skew_s=skew_s)
    truth = local[0] + timedelta(seconds=skew_s)
    assert truth - timedelta(seconds=0.3) <= server.earliest() <= truth
    assert truth <= server.latest() <= truth + timedelta(seconds=0.3)


def test_a_stepped_local_clock_starts_the_estimate_again() -> None:
    local = [T0]
    server = ServerClock(wall=lambda: local[0])
    for step in range(5):
        local[0] = T0 + timedelta(seconds=step * 1.3)
        _answer(server, local=local[0], skew_s=0)
    local[0] += timedelta(hours=1)  # our clock jumped an hour ahead; the server's did not
    _answer(server, local=local[0], skew_s=-3600)
    truth = local[0] - timedelta(hours=1)
    assert truth - timedelta(seconds=1.1) <= server.earliest() <= truth


def test_unreadable_date_headers_are_ignored() -> None:
    server = ServerClock(wall=lambda: T0)
    for header in (None, "", "yesterday", "Tue, 99 Foo 2030 99:00:00 GMT"):
        server.observe(header, sent=T0, got=T0)
    assert server.offset() == (timedelta(0), timedelta(0))


# -- the operator's decisions, on a fake Kube and pinned clocks ------------------------------


class Clocks:
    """The API server's time (what the operator's Kube estimates) and its monotonic clock."""

    def __init__(self) -> None:
        self.wall = T0
        self.mono = 1000.0

    def now(self) -> datetime:
        return self.wall

    def monotonic(self) -> float:
        return self.mono

    def advance(self, seconds: float) -> None:
        self.wall += timedelta(seconds=seconds)
        self.mono += seconds


def task_json(name: str = "t", **spec: Any) -> JSON:
    return {"apiVersion": f"{models.GROUP}/{models.VERSION}", "kind": models.KIND,
            "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "generation": 1,
                         "creationTimestamp": format_time(T0 - timedelta(minutes=5))},
            "spec": {"queue": "q", **spec}, "status": {}}


def held_lease(name: str = "t", *, epoch: int = 1, at: datetime = T0, duration_s: int = 30) -> JSON:
    holder = "agent-0/1"
    return record.encode(LeaseRecord(
        name=name, namespace="ns", queue="q", owner_uid=f"uid-{name}", holder=holder, epoch=epoch,
        duration_s=duration_s, acquired_at=at, renewed_at=at,
        history=(models.Attempt(attempt=epoch, holder=holder, claimed_at=at),)))


def failed_lease(name: str = "t", *, epoch: int = 1, not_before: datetime | None) -> JSON:
    """Attempt `epoch` failed by its holder, with the not-before that holder computed."""
    last = models.Attempt(attempt=epoch, holder="agent-0/1", claimed_at=T0, ended_at=T0, outcome="Failed",
                          message="boom")
    return record.encode(LeaseRecord(name=name, namespace="ns", queue="q", owner_uid=f"uid-{name}", epoch=epoch,
                                     renewed_at=T0, error="boom", not_before=not_before, history=(last,)))


class World:
    """A reconciler over a fake Kube: objects go in as the watches would bring them."""

    def __init__(self) -> None:
        self.clocks = Clocks()
        self.kube = FakeKube()
        self.reconciler = Reconciler(self.kube, grace_s=2.0, clock=self.clocks.now,  # type: ignore[arg-type]
                                     monotonic=self.clocks.monotonic)

    def task(self, obj: JSON) -> JSON:
        stored = self.kube.put(TASKS, obj)
        self.reconciler.on_task("ADDED", stored)
        return stored

    def lease(self, obj: JSON) -> JSON:
        current = self.kube.get_or_none(LEASES, obj["metadata"]["name"], namespace="ns")
        if current is not None:
            obj = {**obj, "metadata": {**obj["metadata"], "uid": current["metadata"]["uid"]}}
        stored = self.kube.put(LEASES, obj)
        self.reconciler.on_lease("MODIFIED" if current else "ADDED", stored, record.read(stored))
        return stored

    def reconcile(self, name: str = "t") -> None:
        self.reconciler.reconcile(("ns", name))

    def lease_writes(self) -> list[JSON]:
        return [body for verb, plural, body in self.kube.writes if plural == "leases"]

    def record(self, name: str = "t") -> LeaseRecord:
        lease = self.kube.get_or_none(LEASES, name, namespace="ns")
        assert lease is not None
        return record.decode(lease)


def test_expiry_uses_the_tasks_duration_not_the_one_its_holder_wrote() -> None:
    world = World()
    world.task(task_json(leaseDurationSeconds=5))
    world.lease(held_lease(duration_s=86400))  # a holder that grants itself a day, then goes silent
    world.clocks.advance(6.9)  # duration 5 + grace 2, not yet
    world.reconcile()
    assert world.lease_writes() == []
    world.clocks.advance(0.1)
    world.reconcile()
    rec = world.record()
    assert rec.state == record.FREE and rec.history[-1].outcome == "Expired"


def test_a_claim_seen_before_spec_not_before_is_undone_and_not_counted() -> None:
    world = World()
    start = T0 + timedelta(seconds=60)
    world.task(task_json(notBefore=format_time(start), maxAttempts=1))
    world.lease(held_lease())  # claimed by an agent whose clock runs a minute ahead
    world.reconcile()
    rec = world.record()
    assert rec.state == record.FREE and rec.not_before == start
    assert rec.history[-1].outcome == "Undone" and rec.epoch == 1
    view = TaskView.of(world.kube.get_or_none(TASKS, "t", namespace="ns") or {})
    assert attempts_used(view, rec) == 0  # its one attempt is still there
    assert claimed(view, rec, "agent-1/1", start).epoch == 2  # and epoch 1 is never handed out again
    assert [e["reason"] for e in world.kube.events()][0] == "Undone"  # a Warning says why


def test_a_claim_seen_after_spec_not_before_stands() -> None:
    world = World()
    world.task(task_json(notBefore=format_time(T0 - timedelta(seconds=1))))
    world.lease(held_lease())
    world.reconcile()
    assert world.lease_writes() == [] and world.record().state == record.HELD


@pytest.mark.parametrize("written_s", [-55.0, 65.0, None], ids=["writer-60s-behind", "writer-60s-ahead", "none"])
def test_a_backoff_is_measured_from_when_the_operator_saw_the_attempt_fail(written_s: float | None) -> None:
    world = World()
    world.task(task_json(backoff={"policy": "Fixed", "initialSeconds": 5, "maxSeconds": 5, "jitter": False}))
    world.lease(held_lease())
    world.clocks.advance(3)
    world.lease(failed_lease(not_before=None if written_s is None else world.clocks.wall + timedelta(
        seconds=written_s)))
    world.reconcile()
    assert world.record().not_before == world.clocks.wall + timedelta(seconds=5)


def test_a_backoff_written_on_time_is_left_alone() -> None:
    world = World()
    world.task(task_json(backoff={"policy": "Fixed", "initialSeconds": 5, "maxSeconds": 5, "jitter": False}))
    world.lease(held_lease())
    world.clocks.advance(3)
    world.lease(failed_lease(not_before=world.clocks.wall + timedelta(seconds=5.4)))
    world.reconcile()
    assert world.lease_writes() == []


def test_a_backoff_found_too_far_ahead_is_cut_to_one_backoff_from_now() -> None:
    world = World()  # an operator that starts now: it did not see the attempt end
    world.task(task_json(backoff={"policy": "Fixed", "initialSeconds": 5, "maxSeconds": 5, "jitter": False}))
    world.lease(failed_lease(not_before=T0 + timedelta(days=1)))
    world.reconcile()
    assert world.record().not_before == T0 + timedelta(seconds=5)


def test_the_ttl_counts_from_when_the_operator_saw_the_task_finish() -> None:
    task = task_json(ttlSecondsAfterFinished=30)
    rec = LeaseRecord(name="t", namespace="ns", queue="q", owner_uid="uid-t", epoch=1, outcome="Succeeded",
                      reason="Completed", renewed_at=T0 - timedelta(hours=1))  # the writer's clock: an hour behind
    status = projection.project(task, rec, old=models.TaskStatus(), now=T0)
    assert status.completed_at == T0
    assert cleanup.delete_at(TaskView.of(task), status, rec, default_ttl_s=None) == T0 + timedelta(seconds=30)
    later = projection.project(task, rec, old=status, now=T0 + timedelta(seconds=10))
    assert later.completed_at == T0 and later == status  # a re-projection keeps it


# -- against the real API server -------------------------------------------------------------


@pytest.fixture(scope="session")
def faketime() -> Path:
    """libfaketime (Debian's `faketime`), installed here when missing: a process's wall clock
    set off by a fixed offset, the way a badly synchronised node's is."""
    def found() -> Path | None:
        return next(iter(sorted(Path("/usr/lib").glob("*/faketime/libfaketime.so.1"))), None)

    if found() is None and shutil.which("apt-get") and os.geteuid() == 0:
        subprocess.run(["apt-get", "install", "-y", "-q", "faketime"], capture_output=True, timeout=300,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    lib = found()
    if lib is None:
        pytest.skip("libfaketime is not installed and `apt-get install faketime` was not possible here")
    return lib


def served_for(cluster: Cluster, seconds: float) -> None:
    """Wait until the API server's certificate is `seconds` old: a client whose clock is that
    far behind refuses a certificate younger than that (not valid yet), as any TLS client
    does. The suite's cluster makes its certificates when it starts."""
    server = yaml.safe_load(cluster.kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
    host, port = urlparse(server).hostname, urlparse(server).port
    assert host is not None and port is not None
    pem = ssl.get_server_certificate((host, port))
    start = subprocess.run(["openssl", "x509", "-noout", "-startdate"], input=pem, capture_output=True, text=True,
                           check=True).stdout.strip().split("=", 1)[1]
    valid_from = datetime.strptime(start, "%b %d %H:%M:%S %Y %Z").replace(tzinfo=UTC)
    time.sleep(max((valid_from + timedelta(seconds=seconds) - now_utc()).total_seconds(), 0))


def skewed(lib: Path, offset_s: int, **env: str) -> dict[str, str]:
    """The environment of a process whose wall clock reads `offset_s` seconds off."""
    return {**os.environ, "LD_PRELOAD": str(lib), "FAKETIME": f"{offset_s:+d}s",
            "FAKETIME_DONT_FAKE_MONOTONIC": "1", **env}


def test_faketime_really_moves_a_python_process_clock(faketime: Path) -> None:
    out = subprocess.run([sys.executable, "-c", "import time; print(time.time())"], capture_output=True, text=True,
                         env=skewed(faketime, 60), check=True).stdout
    assert 55 < float(out) - time.time() < 65


def test_the_kube_client_reads_the_api_servers_time_from_its_answers(cluster: Cluster, namespace: str) -> None:
    admin = cluster.kube(namespace)
    behind = Kube(admin.connection, namespace,
                  server_clock=ServerClock(wall=lambda: now_utc() - timedelta(seconds=60)))
    assert abs((behind.now() - now_utc()).total_seconds() + 60) < 1  # no answer yet: its own clock
    behind.get_or_none(TASKS, "nothing-here")  # a 404 is dated too
    assert abs((behind.now() - now_utc()).total_seconds()) < 1.5  # the API server runs on this machine


def _claim(lib: Path, offset_s: int, config: Path, queue: str, pod: str, *, wait_s: int) -> subprocess.Popen[str]:
    return subprocess.Popen(tasklease_cmd("claim", f"--kubeconfig={config}", "--queue", queue, "--wait", str(wait_s)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=skewed(lib, offset_s, POD_NAME=pod))


def _lease_created(kube: Kube, name: str) -> datetime:
    created = parse_time(kube.get(LEASES, name)["metadata"]["creationTimestamp"])  # the API server's clock
    assert created is not None
    return created


def test_an_agent_a_minute_ahead_does_not_claim_before_not_before(
        cluster: Cluster, kube: Kube, namespace: str, chart_roles: dict[str, str], tmp_path: Path,
        faketime: Path) -> None:
    start = now_utc() + timedelta(seconds=6)
    make_task(kube, "later", queue="ahead", notBefore=format_time(start))
    config = agent_pod_kubeconfig(cluster, namespace, "ahead-0", chart_roles["agent"], tmp_path)
    claim = _claim(faketime, 60, config, "ahead", "ahead-0", wait_s=40)
    out, err = claim.communicate(timeout=60)
    assert claim.returncode == 0, err
    assert json.loads(out)["name"] == "later"
    assert _lease_created(kube, "later") >= start.replace(microsecond=0)  # whole seconds, rounded down


def test_an_agent_a_minute_behind_claims_when_not_before_comes(
        cluster: Cluster, kube: Kube, namespace: str, chart_roles: dict[str, str], tmp_path: Path,
        faketime: Path) -> None:
    served_for(cluster, 65)
    start = now_utc() + timedelta(seconds=4)
    make_task(kube, "soon", queue="behind", notBefore=format_time(start))
    config = agent_pod_kubeconfig(cluster, namespace, "behind-0", chart_roles["agent"], tmp_path)
    claim = _claim(faketime, -60, config, "behind", "behind-0", wait_s=30)
    out, err = claim.communicate(timeout=60)
    assert claim.returncode == 0, err  # not 30 s of waiting for a minute that its clock is behind
    assert start.replace(microsecond=0) <= _lease_created(kube, "soon") <= start + timedelta(seconds=5)


@pytest.mark.parametrize(("failer_s", "claimer_s"), [(60, -60), (-60, 60)],
                         ids=["failer-ahead-claimer-behind", "failer-behind-claimer-ahead"])
def test_a_backoff_between_agents_with_skewed_clocks_lasts_the_tasks_backoff(
        cluster: Cluster, kube: Kube, namespace: str, chart_roles: dict[str, str], tmp_path: Path,
        faketime: Path, failer_s: int, claimer_s: int) -> None:
    served_for(cluster, 65)
    make_task(kube, "flaky", queue="skew",
              backoff={"policy": "Fixed", "initialSeconds": 4, "maxSeconds": 4, "jitter": False})
    failer = agent_pod_kubeconfig(cluster, namespace, "failer-0", chart_roles["agent"], tmp_path)
    first = _claim(faketime, failer_s, failer, "skew", "failer-0", wait_s=20)
    out, err = first.communicate(timeout=60)
    assert first.returncode == 0, err
    held = json.loads(out)
    # The claimer waits on its watch before the failure: it claims the moment it judges the backoff over.
    claimer = agent_pod_kubeconfig(cluster, namespace, "claimer-0", chart_roles["agent"], tmp_path)
    second = _claim(faketime, claimer_s, claimer, "skew", "claimer-0", wait_s=40)
    try:
        wait_for(lambda: any(members.decode(m).holder.startswith("claimer-0/") for m in kube.list(
            LEASES, label_selector=members.LABEL_AGENT_OF)["items"]), timeout=30, message="the claimer waiting")
        subprocess.run(tasklease_cmd("fail", f"--kubeconfig={failer}", "flaky", "--holder", held["holder"],
                                     "--epoch", str(held["epoch"]), "-m", "boom"),
                       check=True, capture_output=True, env=skewed(faketime, failer_s, POD_NAME="failer-0"), timeout=60)
        failed_at = time.monotonic()
        wait_for(lambda: record.decode(kube.get(LEASES, "flaky")).epoch == 2, timeout=30, interval=0.05,
                 message="the second attempt")
        waited = time.monotonic() - failed_at
    finally:
        second.communicate(timeout=60)
    # The failure was written before `fail` returned: the backoff may look up to a second shorter from here.
    assert 4 - 1.5 <= waited <= 4 + 8


def test_a_holder_that_writes_a_days_duration_and_goes_silent_is_expired_in_the_tasks(
        kube: Kube, operator: Operator) -> None:
    make_task(kube, "greedy", leaseDurationSeconds=5)
    protocol = Protocol(kube)
    held = protocol.claim(TaskView.of(kube.get(TASKS, "greedy")), None, "greedy-0/1")
    kube.merge_patch(LEASES, "greedy", {"metadata": {"resourceVersion": held.record.resource_version},
                                        "spec": {"leaseDurationSeconds": 86400}})
    silent_since = time.monotonic()
    wait_for(lambda: record.decode(kube.get(LEASES, "greedy")).state == record.FREE, timeout=5 + 1 + 10,
             message="the expiry of a holder silent for the Task's 5 s")
    assert time.monotonic() - silent_since >= 5 - 0.5
    assert record.decode(kube.get(LEASES, "greedy")).history[-1].outcome == "Expired"


def test_a_claim_made_before_not_before_by_the_servers_clock_is_undone_and_not_counted(
        kube: Kube, operator: Operator) -> None:
    make_task(kube, "early", notBefore=format_time(now_utc() + timedelta(minutes=2)), maxAttempts=1)
    ahead = Protocol(kube, clock=lambda: now_utc() + timedelta(minutes=3))  # an agent that trusts its own clock
    ahead.claim(TaskView.of(kube.get(TASKS, "early")), None, "early-0/1")
    rec = wait_for(lambda: (r := record.decode(kube.get(LEASES, "early"))).state == record.FREE and r,
                   timeout=15, message="the early claim undone")
    assert rec.history[-1].outcome == "Undone" and rec.epoch == 1 and rec.budget_from == 1
    assert attempts_used(TaskView.of(kube.get(TASKS, "early")), rec) == 0  # its one attempt is left


def test_a_backoff_written_with_a_holders_wrong_clock_is_put_right(kube: Kube, operator: Operator) -> None:
    make_task(kube, "wrong", backoff={"policy": "Fixed", "initialSeconds": 5, "maxSeconds": 5, "jitter": False})
    behind = Protocol(kube, clock=lambda: now_utc() - timedelta(seconds=60))  # not-before a minute in the past
    behind.fail(behind.claim(TaskView.of(kube.get(TASKS, "wrong")), None, "wrong-0/1"), "boom")
    failed = now_utc()

    def put_right() -> bool:
        nb = record.decode(kube.get(LEASES, "wrong")).not_before
        return nb is not None and abs((nb - (failed + timedelta(seconds=5))).total_seconds()) < 2

    wait_for(put_right, timeout=15, message="the backoff measured by the operator")


def test_a_tasks_completion_time_is_when_the_operator_saw_it(kube: Kube, operator: Operator) -> None:
    make_task(kube, "done", ttlSecondsAfterFinished=600)
    behind = Protocol(kube, clock=lambda: now_utc() - timedelta(hours=1))
    behind.complete(behind.claim(TaskView.of(kube.get(TASKS, "done")), None, "done-0/1"), "ok")
    status = wait_for(lambda: (s := kube.get(TASKS, "done").get("status") or {}).get("phase") == "Succeeded" and s,
                      timeout=15, message="the task projected Succeeded")
    completed = parse_time(status["completedAt"])
    assert completed is not None and abs((completed - now_utc()).total_seconds()) < 15

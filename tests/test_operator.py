"""The operator against a real API server: expiry, requeue, dead letters, restarts, HA, idle cost."""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from conftest import (NEVER_SCHEDULED, ROOT, Cluster, Operator, Process, audit_lines, audit_since, make_task,
                      tasklease_cmd, wait_for)
from tasklease.protocol import labels, record
from tasklease.kube import LEASES, PODS, TASKS, Kube

NO_BACKOFF = {"initialSeconds": 0, "maxSeconds": 0}
IDLE_WINDOW_S = 30.0


def _hold(config: Path, queue: str, log: Path, pod: str, pod_uid: str = "") -> tuple[Process, dict[str, Any]]:
    """Start a test agent that claims one task of `queue` and holds it (renewing) until killed."""
    proc = Process([sys.executable, str(ROOT / "tests" / "agents" / "hold.py"), str(config), queue,
                    str(log.with_suffix(".never"))], log=log, env={"POD_NAME": pod, "POD_UID": pod_uid})
    claimed = wait_for(lambda: [json.loads(x) for x in proc.output().splitlines() if x.startswith("{")],
                       timeout=30, message=f"{pod} to claim from {queue}")[0]
    return proc, claimed


def _agent_pod(kube: Kube, name: str) -> dict[str, Any]:
    """An agent's Pod object (it never runs: no node matches its nodeSelector)."""
    return kube.create(PODS, {"apiVersion": "v1", "kind": "Pod",
                              "metadata": {"name": name, "labels": {"tasklease.dev/agent": "true"}},
                              "spec": {"automountServiceAccountToken": False, "nodeSelector": NEVER_SCHEDULED,
                                       "containers": [{"name": "agent", "image": "agent:dev"}]}})


def _lease(kube: Kube, name: str) -> record.LeaseRecord:
    return record.decode(kube.get(LEASES, name))


def _in_an_hour() -> str:
    return (datetime.now(UTC) + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")


def _reason(kube: Kube, name: str) -> str:
    return str(kube.get(TASKS, name)["status"]["reason"])


def _phase(kube: Kube, name: str) -> str:
    return str((kube.get(TASKS, name).get("status") or {}).get("phase", ""))


def test_a_killed_agents_task_is_requeued_within_the_lease_duration_and_completed_by_another(
        cluster: Cluster, kube: Kube, namespace: str, operator: Operator, tmp_path: Path) -> None:
    make_task(kube, "orphaned", queue="k", leaseDurationSeconds=5, backoff=NO_BACKOFF)
    config = cluster.namespaced_kubeconfig(namespace, tmp_path)
    holder, claimed = _hold(config, "k", tmp_path / "holder.log", "doomed-agent")
    holder.kill(signal.SIGKILL)
    killed_at = time.monotonic()
    holder.wait(10)
    wait_for(lambda: _lease(kube, "orphaned").state == record.FREE, timeout=30, interval=0.05,
             message="the operator to expire the lease")
    requeued_after = time.monotonic() - killed_at
    # lease duration + grace, plus slack for watch delivery and scheduling on a loaded machine
    assert requeued_after <= 5 + 1 + 2.5, f"requeued after {requeued_after:.1f}s"

    # It waits for work, as a shell agent's loop does: a one-shot look right after the requeue
    # may not find the task until the operator has projected it Pending again.
    other = Process(tasklease_cmd("run", f"--kubeconfig={config}", "--queue", "k", "--wait", "30", "--", "echo",
                                  "rescued"),
                    log=tmp_path / "other.log", env={"POD_NAME": "rescuer"})
    assert other.wait(60) == 0, other.output()
    # The documented wait for a task (its status has no conditions): kubectl waits on the phase.
    waited = cluster.kubectl("wait", "--for=jsonpath={.status.phase}=Succeeded", "task/orphaned", "-n", namespace,
                             "--timeout=60s", check=False)
    assert waited.returncode == 0, waited.stderr
    status = kube.get(TASKS, "orphaned")["status"]
    assert status["result"] == "rescued"
    assert [(a["attempt"], a["outcome"]) for a in status["history"]] == [(1, "Expired"), (2, "Succeeded")]
    assert status["history"][0]["holder"] == claimed["holder"]
    assert operator.metric("tasklease_expirations_total") == 1
    assert operator.metric("tasklease_time_to_requeue_seconds_count") == 1
    reasons = _event_reasons(kube, "orphaned")
    for reason in ("Expired", "Requeued"):  # abnormal: always an Event
        assert reason in reasons
    assert "Claimed" not in reasons and "Succeeded" not in reasons  # happy path: only with --events=all
    assert "Expired" in cluster.kubectl("describe", "task", "orphaned", "-n", namespace).stdout


def test_a_task_that_keeps_failing_is_dead_lettered_with_every_attempt_in_its_history(
        cluster: Cluster, kube: Kube, namespace: str, operator: Operator, tmp_path: Path) -> None:
    make_task(kube, "poison", queue="d", maxAttempts=3, backoff=NO_BACKOFF)
    config = cluster.namespaced_kubeconfig(namespace, tmp_path)
    for attempt in range(3):
        run = Process(tasklease_cmd("run", f"--kubeconfig={config}", "--queue", "d", "--wait", "30", "--",
                                    "sh", "-c", f"echo try {attempt}; exit 1"), log=tmp_path / f"run{attempt}.log")
        assert run.wait(60) == 11, run.output()
    status = wait_for(lambda: _phase(kube, "poison") == "Failed" and kube.get(TASKS, "poison")["status"],
                      message="status Failed")
    assert status["reason"] == "DeadLettered"
    assert [(a["attempt"], a["outcome"]) for a in status["history"]] == [(1, "Failed"), (2, "Failed"), (3, "Failed")]
    # The Event follows the status write that the wait above saw.
    wait_for(lambda: "DeadLettered" in _event_reasons(kube, "poison"), message="the DeadLettered Event")
    wait_for(lambda: operator.metric("tasklease_dead_letters_total") == 1, message="the dead-letter metric")


def test_operator_killed_and_restarted_mid_run_loses_nothing_and_expires_nothing_early(
        cluster: Cluster, kube: Kube, namespace: str, operator_factory: Callable[..., Operator],
        tmp_path: Path) -> None:
    for i in range(24):
        make_task(kube, f"job-{i:02d}", queue="work", leaseDurationSeconds=10)
    make_task(kube, "frozen", queue="freeze", leaseDurationSeconds=10, backoff=NO_BACKOFF)
    config = cluster.namespaced_kubeconfig(namespace, tmp_path)
    first = operator_factory("--no-leader-elect")
    frozen, _ = _hold(config, "freeze", tmp_path / "frozen.log", "frozen-agent")
    workers = [Process(tasklease_cmd("run", f"--kubeconfig={config}", "--queue", "work", "--loop", "--wait", "15",
                                     "--", "sh", "-c", "sleep 0.5; echo ok"),
                       log=tmp_path / f"worker{i}.log", env={"POD_NAME": f"worker-{i}"}) for i in range(3)]
    try:
        wait_for(lambda: sum(_lease_or_none(kube, f"job-{i:02d}") == "closed" for i in range(24)) >= 6,
                 timeout=60, message="a quarter of the jobs done")
        frozen.kill(signal.SIGSTOP)  # its lease now stands still
        first.kill(signal.SIGKILL)
        first.wait(10)
        time.sleep(3)  # the lease ages while no operator runs: a restart must not count this time
        restarted_at = time.monotonic()  # before the process exists: a lower bound of its first look
        second = operator_factory("--no-leader-elect")
        wait_for(lambda: _lease(kube, "frozen").state == record.FREE, timeout=40, interval=0.05,
                 message="the frozen lease to expire")
        expired_after = time.monotonic() - restarted_at
        assert expired_after >= 10 - 0.5, f"expired {expired_after:.1f}s after the restart: early"
        for w in workers:
            assert w.wait(120) == 0, w.output()
    finally:
        frozen.kill(signal.SIGCONT)
        frozen.stop()
        for w in workers:
            w.stop()
    for i in range(24):
        rec = _lease(kube, f"job-{i:02d}")
        assert (rec.outcome, rec.epoch, len(rec.history)) == ("Succeeded", 1, 1), f"job-{i:02d}: {rec}"
    wait_for(lambda: all(_phase(kube, f"job-{i:02d}") == "Succeeded" for i in range(24)), timeout=60,
             message="every status projected Succeeded by the restarted operator")
    assert second.proc.poll() is None


def test_two_replicas_one_active_and_the_standby_takes_over(
        cluster: Cluster, kube: Kube, namespace: str, operator_factory: Callable[..., Operator],
        tmp_path: Path) -> None:
    election = ("--leader-elect", "--leader-election-lease-duration=4")
    active = operator_factory(*election)
    standby = operator_factory(*election, ready_as="standby")
    assert active.metric("tasklease_operator_leader") == 1 and standby.metric("tasklease_operator_leader") == 0

    active.kill(signal.SIGKILL)
    killed_at = time.monotonic()
    standby.wait_ready("leader", timeout=30)
    took_over = time.monotonic() - killed_at
    assert took_over <= 4 + 2, f"standby took over after {took_over:.1f}s"

    # The new leader does the work: a silent holder's task is expired and requeued.
    make_task(kube, "after-failover", queue="ha", leaseDurationSeconds=5, backoff=NO_BACKOFF)
    claim = Process(tasklease_cmd("claim", f"--kubeconfig={cluster.namespaced_kubeconfig(namespace, tmp_path)}",
                                  "--queue", "ha"), log=tmp_path / "claim.log")
    assert claim.wait(30) == 0
    wait_for(lambda: _lease(kube, "after-failover").state == record.FREE, timeout=30,
             message="expiry by the new leader")


@pytest.mark.parametrize("end", ["deleted", "terminated"])
def test_when_the_holders_pod_is_gone_its_task_is_requeued_at_once(
        cluster: Cluster, kube: Kube, namespace: str, operator: Operator, tmp_path: Path, end: str) -> None:
    make_task(kube, "pod-bound", queue="pods", leaseDurationSeconds=120, backoff=NO_BACKOFF)
    _agent_pod(kube, "agent-7")
    config = cluster.namespaced_kubeconfig(namespace, tmp_path)
    holder, _ = _hold(config, "pods", tmp_path / "holder.log", "agent-7")
    try:
        if end == "deleted":
            kube.delete(PODS, "agent-7")
        else:  # what the kubelet reports when the pod's containers have ended
            # A patch, not a replace: a scheduler may have written the pod's conditions meanwhile.
            kube.request("PATCH", PODS.path(namespace, "agent-7", "status"), body={"status": {"phase": "Failed"}},
                         content_type="application/merge-patch+json")
        gone_at = time.monotonic()
        wait_for(lambda: _lease(kube, "pod-bound").state == record.FREE, timeout=30, interval=0.05,
                 message=f"the lease to be expired after its pod was {end}")
        assert time.monotonic() - gone_at < 10  # not the 120 s lease duration
    finally:
        holder.stop()
    assert _lease(kube, "pod-bound").history[0].outcome == "Expired"
    counted = f'tasklease_expirations_total{{cause="pod-gone",namespace="{namespace}",queue="pods"}} 1.0'
    # Counted after the Lease write that the wait above saw.
    wait_for(lambda: counted in operator.get("/metrics")[1], message="the pod-gone expiration counted")


def test_a_pod_recreated_under_the_same_name_keeps_what_it_claims_and_loses_it_when_it_goes(
        cluster: Cluster, kube: Kube, namespace: str, operator: Operator, tmp_path: Path) -> None:
    """A StatefulSet's pod: worker-0 is deleted and comes back under the same name (a new uid)."""
    def pod_gone_expirations() -> float:
        return operator.metric(f'tasklease_expirations_total{{cause="pod-gone",namespace="{namespace}",queue="sts"}}')

    config = cluster.namespaced_kubeconfig(namespace, tmp_path)
    for name in ("before", "after"):
        make_task(kube, name, queue="sts", leaseDurationSeconds=120, maxAttempts=1)  # never claimed twice
    first_uid = _agent_pod(kube, "worker-0")["metadata"]["uid"]
    old, old_claim = _hold(config, "sts", tmp_path / "old.log", "worker-0")
    held = old_claim["claimed"]
    kube.delete(PODS, "worker-0")
    wait_for(lambda: _lease(kube, held).state != record.HELD, message="the old pod's task expired (pod gone)")
    old.kill()  # its container went with its pod
    wait_for(lambda: pod_gone_expirations() == 1, message="one pod-gone expiration counted")

    # The pod's successor claims before the operator has seen it (its Pod object is not even
    # there yet): only the name is the same, and its claim is not expired as "pod gone".
    new, new_claim = _hold(config, "sts", tmp_path / "new.log", "worker-0")
    try:
        other = new_claim["claimed"]
        assert other != held
        wait_for(lambda: (kube.get(TASKS, other).get("status") or {}).get("holder") == new_claim["holder"],
                 message="the operator to project the new pod's claim")
        assert _lease(kube, other).holder == new_claim["holder"]
        assert _agent_pod(kube, "worker-0")["metadata"]["uid"] != first_uid  # now the new pod shows up
        kube.delete(PODS, "worker-0")  # and goes: its task is expired at once (not in 120 s)
        wait_for(lambda: _lease(kube, other).state != record.HELD, message="the new pod's task expired (pod gone)")
    finally:
        new.stop()
    wait_for(lambda: pod_gone_expirations() == 2, message="two pod-gone expirations counted")
    assert [a.outcome for a in _lease(kube, other).history] == ["Expired"]


def test_a_pods_late_deletion_expires_its_own_claims_not_its_successors(
        cluster: Cluster, kube: Kube, namespace: str, operator_factory: Callable[..., Operator],
        tmp_path: Path) -> None:
    """The race a holder's pod uid settles: the next worker-0 (a StatefulSet's) claims while the
    deletion of the old worker-0 has not reached the operator yet. By name and time alone, the
    successor's claim would be expired with its predecessor's."""
    operator = operator_factory("--no-leader-elect", "--workers", "1")  # one at a time, in order
    config = cluster.namespaced_kubeconfig(namespace, tmp_path)
    make_task(kube, "successors", queue="next", leaseDurationSeconds=120, maxAttempts=1)
    make_task(kube, "predecessors", queue="old", leaseDurationSeconds=120, maxAttempts=1)
    old_uid = _agent_pod(kube, "worker-0")["metadata"]["uid"]
    # The successor's Pod object is not there yet; its agent names the uid it will have.
    new, new_claim = _hold(config, "next", tmp_path / "new.log", "worker-0", pod_uid="the-next-worker-0")
    old, old_claim = _hold(config, "old", tmp_path / "old.log", "worker-0", pod_uid=old_uid)
    try:
        assert new_claim["holder"].endswith("@the-next") and old_claim["holder"].endswith(f"@{old_uid[:8]}")
        for name, claim in (("successors", new_claim), ("predecessors", old_claim)):
            wait_for(lambda n=name, c=claim: (kube.get(TASKS, n).get("status") or {}).get("holder") == c["holder"],
                     message=f"the operator to project the claim of {name}")
        kube.delete(PODS, "worker-0")  # the old pod goes
        # Both leases are looked at, the successor's first (it was seen first): once the
        # predecessor's is expired, the successor's has been judged.
        wait_for(lambda: _lease(kube, "predecessors").state != record.HELD, message="the old pod's claim expired")
        assert _lease(kube, "successors").holder == new_claim["holder"]
        assert operator.metric(
            f'tasklease_expirations_total{{cause="pod-gone",namespace="{namespace}",queue="next"}}') == 0
    finally:
        new.stop()
        old.stop()


def test_at_idle_the_operator_makes_no_request_but_its_watches(
        cluster: Cluster, kube: Kube, namespace: str, operator_factory: Callable[..., Operator],
        audit_log: Path, tmp_path: Path) -> None:
    op = operator_factory("--no-leader-elect")
    make_task(kube, "settled", queue="idle")
    run = Process(tasklease_cmd("run", f"--kubeconfig={cluster.namespaced_kubeconfig(namespace, tmp_path)}",
                                "--queue", "idle", "--", "true"), log=tmp_path / "run.log")
    assert run.wait(60) == 0
    wait_for(lambda: _phase(kube, "settled") == "Succeeded", message="the task to settle")
    time.sleep(1)  # let the last status write and its Events land before the window opens
    start = audit_lines(audit_log)
    # The idle window itself: what we measure is the absence of requests. It outlasts every
    # period of the operator's own (queue status and ticks under a second, health 10 s) three times.
    time.sleep(IDLE_WINDOW_S)
    user = f"system:serviceaccount:{namespace}:tasklease-operator"
    # A request refused before authentication (a token not yet valid) is logged without a username.
    before = [e for e in audit_since(audit_log, 0)[:start] if e["user"].get("username") == user]
    during = [e for e in audit_since(audit_log, start) if e["user"].get("username") == user]
    watched = {e["objectRef"]["resource"] for e in before if e["verb"] == "watch"}
    assert {"tasks", "leases", "pods"} <= watched, watched
    assert [(e["verb"], e["requestURI"]) for e in during if e["verb"] != "watch"] == []
    print(f"\nidle {IDLE_WINDOW_S:.0f} s: {len(during)} audit entries from the operator, all watches")

    # The watches are still alive: a change made now is projected at once.
    make_task(kube, "after-idle", queue="idle", notBefore=_in_an_hour())
    wait_for(lambda: _reason(kube, "after-idle") == "Scheduled", message="the operator to see a new task")
    assert op.proc.poll() is None


def _lease_or_none(kube: Kube, name: str) -> str:
    obj = kube.get_or_none(LEASES, name)
    return record.decode(obj).state if obj else ""


def _event_reasons(kube: Kube, name: str) -> list[str]:
    from tasklease.kube import EVENTS

    return [e["reason"] for e in kube.list(EVENTS, field_selector=f"involvedObject.name={name}")["items"]]



def test_a_finished_task_stays_finished_even_if_its_lease_is_deleted_by_hand(
        cluster: Cluster, kube: Kube, namespace: str, operator: Operator, tmp_path: Path) -> None:
    from tasklease.api import errors
    from tasklease.agent import Agent, Identity

    make_task(kube, "done-once", queue="once")
    agent = Agent(kube, identity=Identity(pod="finisher", instance="x"))
    agent.claim("once", timeout=30).complete("first and last")
    wait_for(lambda: _phase(kube, "done-once") == "Succeeded", message="status Succeeded")
    kube.delete(LEASES, "done-once")
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:  # the operator sees the deletion; the phase must not move
        assert _phase(kube, "done-once") == "Succeeded"
        try:
            agent.claim_once("once").release()
            raise AssertionError("a finished task was claimed again")
        except errors.NothingToClaim:
            pass
        time.sleep(0.2)
    agent.close()


def test_renewals_leave_the_task_alone_and_happy_events_are_posted_on_request(
        cluster: Cluster, kube: Kube, namespace: str, operator_factory: Callable[..., Operator],
        tmp_path: Path) -> None:
    operator_factory("--no-leader-elect", "--events=all")
    make_task(kube, "steady", queue="beat", leaseDurationSeconds=5)
    holder, _ = _hold(cluster.namespaced_kubeconfig(namespace, tmp_path), "beat", tmp_path / "holder.log", "beater")
    try:
        wait_for(lambda: _phase(kube, "steady") == "Running", message="status Running")
        time.sleep(1)  # the coalescing window that projected Running closes
        task_version = kube.get(TASKS, "steady")["metadata"]["resourceVersion"]
        versions = {_lease(kube, "steady").resource_version}
        wait_for(lambda: versions.add(_lease(kube, "steady").resource_version) or len(versions) >= 4,
                 interval=0.2, message="three renewals")
        # Each renewal changed the Lease and nothing else: no status write per heartbeat.
        assert kube.get(TASKS, "steady")["metadata"]["resourceVersion"] == task_version
    finally:
        holder.stop()
    wait_for(lambda: "Claimed" in _event_reasons(kube, "steady"), message="the Claimed Event (--events=all)")


def test_the_operator_is_ready_only_once_its_backlog_is_projected(
        cluster: Cluster, kube: Kube, namespace: str, operator_factory: Callable[..., Operator]) -> None:
    start = _in_an_hour()  # a delayed start is projected (Scheduled); a plain waiting task needs no write
    for i in range(150):
        make_task(kube, f"backlog-{i:03d}", queue="backlog", notBefore=start)
    op = operator_factory("--no-leader-elect", ready_as=None)
    wait_for(lambda: op.get("/readyz")[0] == 200, timeout=120, interval=0.05, message="the operator to be ready")
    unprojected = [t["metadata"]["name"] for t in kube.list(TASKS)["items"]
                   if (t.get("status") or {}).get("reason") != "Scheduled"]
    assert unprojected == []


def test_a_waiting_task_reads_pending_without_a_status_write(
        kube: Kube, operator_factory: Callable[..., Operator]) -> None:
    waiting = make_task(kube, "waiting", queue="quiet")
    assert waiting["status"]["phase"] == "Pending"  # the CRD's default, served without a write
    op = operator_factory("--no-leader-elect", ready_as=None)
    wait_for(lambda: op.get("/readyz")[0] == 200, timeout=120, interval=0.05, message="the operator to be ready")
    # Ready means every Task was reconciled: this one was, and needed no write.
    assert kube.get(TASKS, "waiting")["metadata"]["resourceVersion"] == waiting["metadata"]["resourceVersion"]


def test_a_task_made_without_labels_is_labelled_and_moves_when_its_priority_changes(
        kube: Kube, operator: Operator) -> None:
    """`kubectl apply` of a bare Task: without a shard label it would reach every agent's watch.
    A priority edited later moves it to its new band's watches (its rank label)."""
    kube.create(TASKS, {"apiVersion": "tasklease.dev/v1alpha1", "kind": "Task", "metadata": {"name": "bare"},
                        "spec": {"queue": "bare"}})

    def labels_of() -> dict[str, str]:
        return dict(kube.get(TASKS, "bare")["metadata"].get("labels") or {})
    wanted = {labels.LABEL_SHARD: str(labels.shard_of("bare")), labels.LABEL_RANK: labels.rank(0)}
    wait_for(lambda: labels_of() == wanted, message="the operator to label the task")
    kube.merge_patch(TASKS, "bare", {"spec": {"priority": 40}})
    wait_for(lambda: labels_of() == {**wanted, labels.LABEL_RANK: labels.rank(40)},
             message="the operator to label its new rank")

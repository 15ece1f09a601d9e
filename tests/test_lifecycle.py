"""A task's whole life against a real API server: redrive, cleanup, delayed start, instant
cancel, and the failure's stderr where people look for it."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from conftest import Cluster, Operator, Process, make_task, tasklease_cmd, wait_for
from tasklease.agent import Agent
from tasklease.api import timestamps
from tasklease.kube import EVENTS, LEASES, TASKS, Kube
from tasklease.protocol import record

NO_BACKOFF = {"initialSeconds": 0, "maxSeconds": 0}


def _cli(config: Path) -> Callable[..., subprocess.CompletedProcess[str]]:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(tasklease_cmd(*args), capture_output=True, text=True, timeout=120,
                              env={**os.environ, "KUBECONFIG": str(config)})
    return run


def _status(kube: Kube, name: str) -> dict[str, Any]:
    return dict(kube.get(TASKS, name).get("status") or {})


def test_a_dead_lettered_task_is_retried_with_a_fresh_budget_and_its_stderr_is_kept(
        cluster: Cluster, kube: Kube, namespace: str, operator: Operator, tmp_path: Path) -> None:
    cli = _cli(cluster.namespaced_kubeconfig(namespace, tmp_path))
    make_task(kube, "flaky", queue="redrive", maxAttempts=2, backoff=NO_BACKOFF)
    make_task(kube, "fine", queue="redrive-ok")
    failing = "echo working; echo 'disk full on /data' >&2; exit 3"
    for _ in range(2):
        ran = cli("run", "--queue", "redrive", "--wait", "30", "--", "sh", "-c", failing)
        assert ran.returncode == 11, ran.stderr
        assert "disk full on /data" in ran.stderr  # still echoed to the agent's own stderr
    status = wait_for(lambda: _status(kube, "flaky").get("reason") == "DeadLettered" and _status(kube, "flaky"),
                      message="dead-lettered")
    assert status["lastError"] == "sh exited with code 3: disk full on /data"
    assert [a["message"] for a in status["history"]] == ["sh exited with code 3: disk full on /data"] * 2

    assert cli("run", "--queue", "redrive-ok", "--", "true").returncode == 0
    wait_for(lambda: _status(kube, "fine").get("phase") == "Succeeded", message="fine succeeded")
    refused = cli("retry", "fine")
    assert refused.returncode == 9 and "never re-run" in refused.stderr, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1

    retried = cli("retry", "--queue", "redrive", "--reason", "DeadLettered")
    assert retried.returncode == 0, retried.stderr
    assert "task/flaky retried" in retried.stdout
    wait_for(lambda: _status(kube, "flaky").get("phase") == "Pending", message="back to Pending")
    assert cli("run", "--queue", "redrive", "--wait", "30", "--", "echo", "fixed").returncode == 0
    status = wait_for(lambda: _status(kube, "flaky").get("phase") == "Succeeded" and _status(kube, "flaky"),
                      message="succeeded after the retry")
    assert status["attempt"] == 3  # the epoch went on from 2: never repeated
    assert [(a["attempt"], a["outcome"]) for a in status["history"]] == [(1, "Failed"), (2, "Failed"),
                                                                          (3, "Succeeded")]
    assert status["result"] == "fixed"
    assert "Retried:    2 more attempts counted from attempt 3" in cli("describe", "flaky").stdout
    reasons = [e["reason"] for e in kube.list(EVENTS, field_selector="involvedObject.name=flaky")["items"]]
    assert reasons.count("DeadLettered") == 1 and "Retried" in reasons
    # A second retry of the same (now Succeeded) task is refused; nothing matches the selector any more.
    again = cli("retry", "--queue", "redrive")
    assert again.returncode == 0 and "no Failed task matched" in again.stderr


def test_finished_tasks_are_cleaned_up_after_their_ttl_but_dead_letters_are_kept(
        cluster: Cluster, kube: Kube, namespace: str, operator_factory: Callable[..., Operator],
        tmp_path: Path) -> None:
    operator_factory("--no-leader-elect", "--ttl-seconds-after-finished=1")
    cli = _cli(cluster.namespaced_kubeconfig(namespace, tmp_path))
    make_task(kube, "dead", queue="ttl-dead", maxAttempts=1)
    make_task(kube, "kept", queue="ttl-kept", ttlSecondsAfterFinished=3600)
    make_task(kube, "short", queue="ttl-short")  # the operator's default: 1 s
    assert cli("run", "--queue", "ttl-dead", "--", "false").returncode == 11
    wait_for(lambda: _status(kube, "dead").get("reason") == "DeadLettered", message="dead-lettered")
    for queue in ("ttl-kept", "ttl-short"):
        assert cli("run", "--queue", queue, "--", "true").returncode == 0
    wait_for(lambda: kube.get_or_none(TASKS, "short") is None, message="the finished task to be deleted")
    wait_for(lambda: kube.get_or_none(LEASES, "short") is None, message="its Lease to go with it")
    wait_for(lambda: _status(kube, "kept").get("phase") == "Succeeded", message="kept projected Succeeded")
    assert _status(kube, "dead")["reason"] == "DeadLettered"  # finished before, and still here
    assert kube.get_or_none(LEASES, "dead") is not None


def test_a_delayed_task_starts_no_earlier_than_its_not_before(
        cluster: Cluster, kube: Kube, namespace: str, operator: Operator, tmp_path: Path) -> None:
    config = cluster.namespaced_kubeconfig(namespace, tmp_path)
    cli = _cli(config)
    start = timestamps.now_utc() + timedelta(seconds=4)
    submitted = cli("submit", "--queue", "later", "--name", "later", "--not-before",
                    timestamps.format_time(start) or "")
    assert submitted.returncode == 0, submitted.stderr
    assert "Scheduled" == wait_for(lambda: _status(kube, "later").get("reason"), message="projected")
    shown = cluster.kubectl("get", "tasks", "-n", namespace).stdout
    assert "NOT-BEFORE" in shown and (timestamps.format_time(start) or "")[:19] in shown
    agent = Process(tasklease_cmd("run", f"--kubeconfig={config}", "--queue", "later", "--wait", "60", "--", "true"),
                    log=tmp_path / "agent.log")
    assert agent.wait(90) == 0, agent.output()
    rec = record.decode(kube.get(LEASES, "later"))
    assert rec.history[0].claimed_at is not None and rec.history[0].claimed_at >= start


def test_without_the_operator_a_waiting_agent_wakes_for_a_delayed_start(kube: Kube) -> None:
    """No event arrives when notBefore passes: the agent's own index must wake it (an agent
    with nothing to wait for sleeps a minute between looks)."""
    start = timestamps.now_utc() + timedelta(seconds=3)
    make_task(kube, "soon", queue="soon", notBefore=timestamps.format_time(start))
    agent = Agent(kube)
    try:
        with agent.claim("soon", timeout=30) as task:
            assert timestamps.now_utc() >= start
            task.complete("")
    finally:
        agent.close()


def test_the_holder_stops_at_once_when_its_task_is_cancelled_or_deleted(
        cluster: Cluster, kube: Kube, namespace: str, tmp_path: Path) -> None:
    """No operator runs: the holder learns it from its watch, long before its next renewal
    (a third of the 300 s lease duration)."""
    config = cluster.namespaced_kubeconfig(namespace, tmp_path)
    cli = _cli(config)
    for name, end in (("to-cancel", lambda: cli("cancel", "to-cancel")),
                      ("to-delete", lambda: cluster.kubectl("delete", "task", "to-delete", "-n", namespace))):
        make_task(kube, name, queue=name, leaseDurationSeconds=300)
        marker = tmp_path / f"{name}.started"
        agent = Process(tasklease_cmd("run", f"--kubeconfig={config}", "--queue", name, "--wait", "30", "--",
                                      "sh", "-c", f"touch {marker}; exec sleep 600"),
                        log=tmp_path / f"{name}.log")
        wait_for(marker.exists, message=f"{name} to start")
        assert end().returncode == 0
        code = agent.wait(30)
        assert code == 4, agent.output()  # lost ownership: the command was stopped
        assert ("was cancelled" if name == "to-cancel" else "was deleted") in agent.output()
        rec = record.decode(obj) if (obj := kube.get_or_none(LEASES, name)) else None
        assert rec is None or rec.epoch == 1


def test_a_task_claimed_again_by_its_agent_still_hears_of_its_cancel(kube: Kube) -> None:
    """No operator runs: only the holder's follow of its Task tells it of a cancel. The first
    claim's follow ends when it ends, not later (at its first renewal's turn, which here comes
    while the second claim holds the task: ending it then would end the second's too)."""
    make_task(kube, "again", queue="again", leaseDurationSeconds=6)  # first renewal after 2 s
    agent = Agent(kube)
    try:
        agent.claim("again", timeout=30).release("once more")
        second = agent.claim("again", timeout=30)
        renewed = second.held.record.resource_version
        wait_for(lambda: record.decode(kube.get(LEASES, "again")).resource_version != renewed,
                 message="the second claim's first renewal: the first claim's turn has passed")
        kube.merge_patch(TASKS, "again", {"spec": {"cancel": True}})
        wait_for(second.lost.is_set, timeout=30, message="the second claim to hear of the cancel")
        assert "cancelled" in second.lost_reason
    finally:
        agent.close()

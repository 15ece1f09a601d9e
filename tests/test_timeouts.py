"""Attempt timeouts: the operator's decision on an injected clock, the ending's rules, the
holder's news of it; then a real operator timing out a stuck holder, and `tasklease run --timeout`."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import argparse

import pytest

from conftest import Cluster, Operator, make_task, tasklease_cmd, wait_for
from test_chart import _helm, by_kind, render, CHART
from tasklease.agent import Agent
from tasklease.agent.cancel import attempt_over
from tasklease.api import errors, models, timestamps
from tasklease.kube import EVENTS, LEASES, TASKS, Kube
from tasklease.operator import decision, options, projection
from tasklease.operator.timeouts import AttemptClock, limit_s
from tasklease.protocol import record
from tasklease.protocol.rules import TaskView, claimed, requeued

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
NO_BACKOFF = {"initialSeconds": 0, "maxSeconds": 0}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _task(**spec: object) -> TaskView:
    return TaskView(name="t", namespace="ns", uid="uid-1", spec=models.TaskSpec.model_validate({"queue": "q", **spec}),
                    created="2026-01-01T00:00:00Z")


def _held(task: TaskView, epoch_before: int = 0, rv: str = "1") -> record.LeaseRecord:
    free = record.LeaseRecord(name="t", namespace="ns", queue="q", owner_uid="uid-1", epoch=epoch_before)
    return replace(claimed(task, free, "pod/1", NOW), resource_version=rv)


# -- the decision, on the operator's clock ---------------------------------------------------


def _overran(attempts: AttemptClock[str], clock: Clock, task: TaskView, rec: record.LeaseRecord,
             default_s: int | None = None) -> float | None:
    """Seconds the attempt `rec` holds has run once past its timeout (`decision.decide`); None while within it."""
    action = decision.decide(task, rec, _seen(attempts, rec), decision.Now(NOW, clock.now),
                             decision.Settings(grace_s=0, attempt_timeout_s=default_s))
    return action.ran_s if isinstance(action, decision.TimeOut) else None


def _seen(attempts: AttemptClock[str], rec: record.LeaseRecord) -> decision.Observed:
    sighting = attempts.sighting("t")
    return decision.Observed(attempt_since=sighting.first_seen if sighting and sighting.epoch == rec.epoch else None)


def _due(attempts: AttemptClock[str], clock: Clock, task: TaskView, rec: record.LeaseRecord) -> float | None:
    return decision.next_look(task, rec, _seen(attempts, rec), decision.Now(NOW, clock.now),
                              decision.Settings(grace_s=0), delete_at=None)


def test_an_attempt_times_out_its_limit_after_the_operator_first_saw_the_claim_not_after_renewals() -> None:
    clock = Clock()
    attempts: AttemptClock[str] = AttemptClock(clock)
    task = _task(attemptTimeoutSeconds=30)
    rec = _held(task)
    attempts.observe("t", rec)
    clock.now += 20
    renewed = replace(rec, resource_version="2", renewed_at=NOW)
    attempts.observe("t", renewed)  # a renewal is the same attempt: its clock keeps running
    assert _due(attempts, clock, task, renewed) == 130.0
    clock.now += 9.9
    assert _overran(attempts, clock, task, renewed) is None
    clock.now += 0.1
    assert _overran(attempts, clock, task, renewed) == 30.0


def test_the_holders_own_times_do_not_count_only_when_the_operator_saw_the_claim() -> None:
    clock = Clock()
    attempts: AttemptClock[str] = AttemptClock(clock)
    task = _task(attemptTimeoutSeconds=10)
    # A holder claiming "a day ago" by its clock: the attempt still has its whole timeout from now.
    rec = replace(_held(task), acquired_at=datetime(2025, 12, 31, tzinfo=UTC))
    attempts.observe("t", rec)
    clock.now += 9
    assert _overran(attempts, clock, task, rec) is None


def test_a_new_attempt_starts_a_new_clock_and_an_ended_one_stops_it() -> None:
    clock = Clock()
    attempts: AttemptClock[str] = AttemptClock(clock)
    task = _task(attemptTimeoutSeconds=10)
    first = _held(task)
    attempts.observe("t", first)
    clock.now += 8
    freed = requeued(first, task.spec, outcome="Failed", message="boom", now=NOW, backoff=False)
    attempts.observe("t", freed)
    assert _due(attempts, clock, task, first) is None
    second = _held(task, epoch_before=1, rv="3")
    attempts.observe("t", second)
    clock.now += 8
    assert _overran(attempts, clock, task, second) is None  # 8 s into attempt 2, not 16
    assert _overran(attempts, clock, task, first) is None  # a decision on an older attempt is never made
    attempts.forget("t")
    clock.now += 100
    assert _overran(attempts, clock, task, second) is None


def test_the_tasks_own_timeout_wins_over_the_operators_default_and_none_means_never() -> None:
    assert limit_s(_task(attemptTimeoutSeconds=5).spec, 60) == 5
    assert limit_s(_task().spec, 60) == 60
    assert limit_s(_task().spec, None) is None
    clock = Clock()
    attempts: AttemptClock[str] = AttemptClock(clock)
    rec = _held(_task())
    attempts.observe("t", rec)
    clock.now += 10 ** 6
    assert _overran(attempts, clock, _task(), rec) is None
    clock.now = 100.0
    attempts.forget("t")
    attempts.observe("t", rec)
    clock.now += 60
    assert _overran(attempts, clock, _task(), rec, default_s=60) == 60


# -- the ending: retryable, counted, dead-lettered when spent, an Event --------------------------


def test_a_timed_out_attempt_is_requeued_with_backoff_then_dead_lettered_when_attempts_are_spent() -> None:
    task = _task(maxAttempts=2, attemptTimeoutSeconds=10,
                 backoff={"initialSeconds": 5, "maxSeconds": 60, "jitter": False})
    first = requeued(_held(task), task.spec, outcome=models.ATTEMPT_TIMED_OUT, message="ran 10.0s", now=NOW,
                     backoff=True)
    assert first.state == record.FREE and first.not_before is not None and first.error == "ran 10.0s"
    assert first.history[-1].outcome == models.ATTEMPT_TIMED_OUT
    second = requeued(claimed(task, first, "pod/2", NOW), task.spec, outcome=models.ATTEMPT_TIMED_OUT,
                      message="ran 10.1s", now=NOW, backoff=True)
    assert (second.state, second.outcome, second.reason) == (record.CLOSED, "Failed", "DeadLettered")
    assert second.error == "ran 10.1s"


def test_a_timeout_is_a_warning_event_named_attempt_timed_out() -> None:
    old = models.TaskStatus(phase=models.Phase.RUNNING, attempt=1, history=[
        models.Attempt(attempt=1, holder="pod/1", claimed_at=NOW)])
    new = models.TaskStatus(phase=models.Phase.PENDING, attempt=1, history=[
        models.Attempt(attempt=1, holder="pod/1", claimed_at=NOW, ended_at=NOW, outcome=models.ATTEMPT_TIMED_OUT,
                       message="ran 30.2s, past its attempt timeout of 30s")])
    events = [(t.type, t.reason, t.message) for t in projection.transitions(old, new)]
    assert ("Warning", "AttemptTimedOut", "attempt 1 of pod/1: ran 30.2s, past its attempt timeout of 30s") in events


# -- the holder's news, from its watch of the Task ---------------------------------------------


def test_the_holder_hears_its_attempt_ended_by_someone_else_but_not_an_older_attempt_or_its_own_ending() -> None:
    timed_out = {"attempt": 3, "history": [{"attempt": 2, "outcome": "Failed"},
                                            {"attempt": 3, "outcome": "AttemptTimedOut", "message": "ran 30.1s"}]}
    assert attempt_over(timed_out, 3) == "attempt 3 ended AttemptTimedOut: ran 30.1s"
    assert attempt_over(timed_out, 4) is None  # a status from before our claim: only older attempts
    assert attempt_over({"attempt": 3, "history": [{"attempt": 3, "outcome": "Failed"}]}, 3) is None  # our own
    assert attempt_over({"attempt": 3, "history": [{"attempt": 3}]}, 3) is None  # running
    assert attempt_over({"attempt": 4, "history": []}, 3) == "attempt 4 started after attempt 3"
    assert attempt_over(timed_out, 0) is None  # no epoch given: only cancel and deletion end it


# -- configuration ------------------------------------------------------------------------------


def test_the_operators_default_comes_from_a_flag_and_the_charts_value_and_zero_is_refused() -> None:
    parser = argparse.ArgumentParser()
    options.add_operator_arguments(parser)
    assert parser.parse_args([]).attempt_timeout is None
    with pytest.raises(errors.Invalid, match="--attempt-timeout must be at least 1 second"):
        options.validate(parser.parse_args(["--attempt-timeout", "0"]))

    def args(*sets: str) -> list[str]:
        return list(by_kind(render(*sets), "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"])
    assert not [a for a in args() if a.startswith("--attempt-timeout")]
    assert "--attempt-timeout=600" in args("operator.attemptTimeoutSeconds=600")
    refused = _helm("template", "rel", str(CHART), "--set", "operator.attemptTimeoutSeconds=0")
    assert refused.returncode != 0 and "schema" in refused.stderr, refused.stderr


def test_submit_sets_the_attempt_timeout_and_the_backoff_jitter() -> None:
    from tasklease.cli.main import build_parser
    from tasklease.cli.tasks import _task_from_flags

    args = build_parser().parse_args(["submit", "--queue", "q", "--attempt-timeout", "90", "--no-backoff-jitter"])
    spec = _task_from_flags(args)["spec"]
    assert (spec["attemptTimeoutSeconds"], spec["backoff"]) == (90, {"jitter": False})
    plain = _task_from_flags(build_parser().parse_args(["submit", "--queue", "q"]))["spec"]
    assert "attemptTimeoutSeconds" not in plain and "backoff" not in plain


# -- a real operator and a real holder -------------------------------------------------------


def test_a_stuck_holder_is_timed_out_requeued_and_told_by_its_watch_not_its_next_renewal(
        cluster: Cluster, kube: Kube, namespace: str, operator: Operator, tmp_path: Path) -> None:
    # Renewals every 5 s (a third of the lease): one at 5 s, before the timeout at 7 s; the
    # next, which would be refused, at 10 s. Told well before then, the holder heard it from
    # its watch of the queue's Tasks.
    timeout_s = 7
    make_task(kube, "stuck", queue="tq", attemptTimeoutSeconds=timeout_s, leaseDurationSeconds=15, maxAttempts=2,
              backoff={**NO_BACKOFF, "jitter": False})
    agent = Agent.connect(kubeconfig=str(cluster.namespaced_kubeconfig(namespace, tmp_path)))
    try:
        task = agent.claim("tq", timeout=30, interrupt=False)
        claimed_at = time.monotonic()
        told_at: list[datetime] = []
        task.on_lost.append(lambda _t: told_at.append(datetime.now(UTC)))
        # The holder renews all along (a live agent whose work is stuck), and the
        # Lease claims it was acquired and renewed an hour from now: neither moves the timeout.
        later = timestamps.format_time(datetime.now(UTC) + timedelta(hours=1))
        patched = kube.merge_patch(LEASES, "stuck", {"spec": {"acquireTime": later, "renewTime": later}})
        wait_for(lambda: kube.get(LEASES, "stuck")["metadata"]["resourceVersion"] != patched["metadata"][
            "resourceVersion"], timeout=timeout_s, interval=0.05, message="a renewal before the timeout")
        assert not task.lost.is_set()
        assert task.lost.wait(timeout_s + 5), "the holder was never told"
        told = datetime.now(UTC)
        told_after = time.monotonic() - claimed_at
        assert timeout_s <= told_after < timeout_s + 3, told_after
        assert "AttemptTimedOut" in task.lost_reason, task.lost_reason
        lease = record.decode(kube.get(LEASES, "stuck"))
        assert lease.state == record.FREE and lease.history[-1].outcome == models.ATTEMPT_TIMED_OUT
        assert "past its attempt timeout of 7s (spec.attemptTimeoutSeconds)" in lease.history[-1].message
        ended_at = lease.history[-1].ended_at  # the operator's write, by this machine's clock as ours
        # The refused renewal would come about 3 s after the operator's write.
        assert ended_at is not None and (told - ended_at).total_seconds() < 2.0, (ended_at, told)
        # on_lost callbacks run on a thread of their own, after `lost` is set.
        wait_for(lambda: bool(told_at), timeout=5, interval=0.05, message="the on_lost callback")
        try:
            agent.protocol.renew(task.held)
            raise AssertionError("the timed-out holder could still renew")
        except errors.LostLease:
            pass
        status = kube.get(TASKS, "stuck")["status"]
        assert (status["phase"], status["attempt"]) == ("Pending", 1), status
        assert "past its attempt timeout" in status["lastError"], status
        events = wait_for(lambda: [e for e in kube.list(EVENTS)["items"] if e["reason"] == "AttemptTimedOut"],
                          message="an AttemptTimedOut Event")
        assert events[0]["type"] == "Warning" and events[0]["involvedObject"]["name"] == "stuck"
        assert operator.metric("tasklease_attempt_timeouts_total") == 1
        # The second and last attempt times out too: dead-lettered.
        again = agent.claim("tq", timeout=30, interrupt=False)
        assert again.epoch == 2
        assert again.lost.wait(timeout_s + 5)
        wait_for(lambda: (kube.get(TASKS, "stuck").get("status") or {}).get("reason") == "DeadLettered",
                 message="dead-lettered after its last attempt timed out")
    finally:
        agent.close()


def test_the_operators_default_times_out_a_task_without_its_own_limit(
        cluster: Cluster, kube: Kube, namespace: str, operator_factory: Callable[..., Operator],
        tmp_path: Path) -> None:
    operator_factory("--no-leader-elect", "--attempt-timeout=2")
    make_task(kube, "plain", queue="dq", leaseDurationSeconds=30, backoff=NO_BACKOFF)
    agent = Agent.connect(kubeconfig=str(cluster.namespaced_kubeconfig(namespace, tmp_path)))
    try:
        task = agent.claim("dq", timeout=30, interrupt=False)
        assert task.lost.wait(2 + 5), "the operator's --attempt-timeout did not end the attempt"
        assert task.lost_reason.endswith("past its attempt timeout of 2s (--attempt-timeout)"), task.lost_reason
    finally:
        agent.close()


def test_tasklease_run_stops_a_command_past_its_timeout_and_fails_the_attempt(
        cluster: Cluster, kube: Kube, namespace: str, tmp_path: Path) -> None:
    make_task(kube, "flag", queue="rt", backoff=NO_BACKOFF)
    make_task(kube, "spec", queue="rs", attemptTimeoutSeconds=1, backoff=NO_BACKOFF)
    env = {**os.environ, "KUBECONFIG": str(cluster.namespaced_kubeconfig(namespace, tmp_path))}
    for name, queue, extra in (("flag", "rt", ["--timeout", "1"]), ("spec", "rs", [])):
        started = time.monotonic()
        ran = subprocess.run(tasklease_cmd("run", "--queue", queue, "--grace", "1", *extra, "--",
                                           sys.executable, "-c", "import time; time.sleep(60)"),
                             capture_output=True, text=True, timeout=60, env=env)
        assert ran.returncode == errors.RUN_COMMAND_FAILED, ran.stderr
        assert time.monotonic() - started < 30, "the command was not stopped at its timeout"
        last = record.decode(kube.get(LEASES, name)).history[-1]
        assert last.outcome == "Failed" and last.message.startswith("AttemptTimedOut: "), last
        assert "timed out after 1s" in ran.stderr, ran.stderr
    refused = subprocess.run(tasklease_cmd("run", "--queue", "rt", "--timeout", "0", "--", "true"),
                             capture_output=True, text=True, timeout=60, env=env)
    assert refused.returncode == errors.BadArguments.exit_code
    assert "--timeout must be more than 0 seconds" in refused.stderr and "Traceback" not in refused.stderr

"""Robust readers (issue 30): a malformed or foreign Lease never stops an agent, the operator,
or the projection of other tasks. It is skipped or cut, counted, and told on its Task.

The decoding and the operator's handling on a fake Kube (milliseconds); then a real API
server, the operator and a `tasklease run --loop` agent with the chart's rights.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from conftest import Cluster, Operator, Process, agent_pod_kubeconfig, make_task, tasklease_cmd, wait_for
from fake_kube import FakeKube
from tasklease.agent import Agent, Identity

from tasklease.api import errors, models
from tasklease.kube import EVENTS, JSON, LEASES, TASKS, Kube
from tasklease.operator import metrics, projection
from tasklease.operator.reconciler import Reconciler
from tasklease.protocol import LeaseRecord, Protocol, TaskView, members, record

pytestmark = pytest.mark.adversarial

NOW = datetime(2030, 1, 1, tzinfo=UTC)
NESTED = "[" * 50_000 + "]" * 50_000  # within the API server's limit on an annotation's size


def lease(name: str = "t", *, annotations: dict[str, str] | None = None, holder: str | None = None,
          labels: bool = True, owner_uid: str | None = None) -> JSON:
    body = record.encode(LeaseRecord(name=name, namespace="ns", queue="q", owner_uid=owner_uid or f"uid-{name}",
                                     holder=holder or "", epoch=1 if holder else 0))
    body["metadata"]["annotations"] = annotations or {}
    if not labels:
        body["metadata"].pop("labels")
    return body


@pytest.mark.parametrize(("change", "reason"), [
    ({"annotations": {record.ANN_HISTORY: "not json"}}, "history"),
    ({"annotations": {record.ANN_HISTORY: NESTED}}, "history"),
    ({"annotations": {record.ANN_HISTORY: '{"attempt": 1}'}}, "history"),
    ({"annotations": {record.ANN_HISTORY: '[{"attempt": 1, "holder": "' + "h" * 600 + '"}]'}}, "history"),
    ({"annotations": {record.ANN_HISTORY: f'[{{"attempt": {record.MAX_EPOCH + 1}, "holder": "h"}}]'}}, "history"),
    ({"annotations": {record.ANN_OUTCOME: "Exploded"}}, "outcome"),
    ({"annotations": {record.ANN_NOT_BEFORE: "tomorrow"}}, "timestamp"),
    ({"annotations": {record.ANN_NOT_BEFORE: "2030-01-01T00:00:00"}}, "timestamp"),  # no zone: nobody's clock
    ({"annotations": {record.ANN_BUDGET_FROM: "lots"}}, "number"),
    ({"annotations": {record.ANN_BUDGET_FROM: "-3"}}, "number"),
    ({"annotations": {record.ANN_OUTCOME: "Succeeded", record.ANN_RESULT: "x" * (models.MAX_RESULT_BYTES + 1)}},
     "too-long"),
    ({"annotations": {record.ANN_REASON: "r" * 65}}, "too-long"),
    ({"holder": "h" * 513}, "too-long"),
], ids=["history-not-json", "history-nested", "history-not-a-list", "history-overlong-holder",
        "history-attempt-beyond-any-epoch", "unknown-outcome",
        "bad-time", "time-without-zone", "budget-not-a-number", "budget-negative", "result-too-long",
        "reason-too-long", "holder-too-long"])
def test_a_malformed_lease_is_read_with_what_can_be_used(change: dict[str, Any], reason: str) -> None:
    rec = record.decode(lease(**change))
    assert reason in rec.malformed
    assert rec.outcome in ("", *models.TERMINAL_PHASES)
    assert rec.budget_from >= 0


def test_a_state_label_that_is_not_the_leases_state_is_malformed() -> None:
    body = lease()
    assert "state-label" not in record.decode(body).malformed
    body["metadata"]["labels"][record.LABEL_STATE] = "weird"  # hides a free Lease from the agents' watch
    assert "state-label" in record.decode(body).malformed
    del body["metadata"]["labels"][record.LABEL_STATE]
    assert "state-label" in record.decode(body).malformed


def test_a_lease_without_labels_annotations_or_owner_is_read_as_foreign() -> None:
    body = lease(labels=False)
    body["metadata"].pop("ownerReferences")
    body["metadata"].pop("annotations")
    rec = record.decode(body)
    assert (rec.owner_uid, rec.queue, rec.malformed) == ("", "", ())


def test_an_agent_reads_an_unreadable_history_as_none() -> None:
    assert record.decode_history("not json") == () and record.decode_history(NESTED) == ()


def test_a_member_lease_nested_past_the_json_decoder_is_still_a_peer() -> None:
    body = {"metadata": {"name": "m", "annotations": {members.ANN_TOOK: NESTED, members.ANN_HOLDING: "x"}},
            "spec": {"holderIdentity": "agent-0/1"}}
    member = members.decode(body)
    assert (member.holder, member.took, member.holding) == ("agent-0/1", (), 0)


def test_fields_too_long_for_the_status_are_cut_to_fit_and_marked() -> None:
    rec = record.decode(lease(annotations={record.ANN_OUTCOME: "Succeeded", record.ANN_REASON: "r" * 500,
                                           record.ANN_RESULT: "x" * 20_000, record.ANN_ERROR: "e" * 5000}))
    task = {"metadata": {"name": "t", "namespace": "ns", "uid": "uid-t", "generation": 1}, "spec": {"queue": "q"}}
    status = projection.project(task, rec, old=models.TaskStatus(), now=NOW)
    written = models.TaskStatus.model_validate(status.model_dump(mode="json", by_alias=True))  # the CRD's bounds
    assert len(written.result) == models.MAX_RESULT_BYTES and written.result.endswith("...[cut]")
    assert len(written.reason) == record.MAX_REASON_CHARS


# -- the operator, on a fake Kube --------------------------------------------------------------


def task_json(name: str = "t") -> JSON:
    return {"apiVersion": f"{models.GROUP}/{models.VERSION}", "kind": models.KIND,
            "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "generation": 1,
                         "creationTimestamp": "2030-01-01T00:00:00Z"},
            "spec": {"queue": "q"}, "status": {}}


def _count(reason: str) -> float:
    return metrics.REGISTRY.get_sample_value("tasklease_malformed_objects_total",
                                             {"kind": "Lease", "reason": reason}) or 0.0


def test_the_operator_projects_a_malformed_lease_counts_it_and_tells_it_once() -> None:
    kube = FakeKube()
    reconciler = Reconciler(kube, grace_s=1.0, clock=lambda: NOW)  # type: ignore[arg-type]
    reconciler.on_task("ADDED", kube.put(TASKS, task_json()))
    before = _count("history"), _count("too-long")
    bad = lease(annotations={record.ANN_OUTCOME: "Succeeded", record.ANN_RESULT: "x" * 9000,
                             record.ANN_HISTORY: "not json"})
    event = kube.put(LEASES, bad)
    reconciler.on_lease("ADDED", event, record.read(event))
    reconciler.reconcile(("ns", "t"))
    reconciler.reconcile(("ns", "t"))
    assert (_count("history"), _count("too-long")) == (before[0] + 1, before[1] + 1)
    status = (kube.get_or_none(TASKS, "t", namespace="ns") or {})["status"]
    assert status["phase"] == "Succeeded" and len(status["result"]) == models.MAX_RESULT_BYTES
    assert [e["reason"] for e in kube.events()].count("MalformedLease") == 1


class RefusingKube(FakeKube):
    def __init__(self, error: errors.TaskleaseError) -> None:
        super().__init__()
        self.error = error

    def replace(self, res: Any, body: JSON, *, sub: str | None = None, timeout: float = 30) -> JSON:
        raise self.error


@pytest.fixture
def working() -> Iterator[Any]:
    stops: list[threading.Event] = []

    def start(reconciler: Reconciler) -> None:
        stop = threading.Event()
        stops.append(stop)
        reconciler.active.set()
        threading.Thread(target=reconciler.run, args=(stop,), daemon=True).start()

    yield start
    for stop in stops:
        stop.set()


@pytest.mark.parametrize(("error", "ready"), [(errors.Invalid("status.result: Too long"), True),
                                              (errors.Refused("denied request: a rule about this object"), True),
                                              (errors.Forbidden("no rights"), False)])
def test_one_objects_refused_write_does_not_make_the_operator_unready(
        working: Any, error: errors.TaskleaseError, ready: bool) -> None:
    kube = RefusingKube(error)
    reconciler = Reconciler(kube, grace_s=1.0, workers=1, clock=lambda: NOW)  # type: ignore[arg-type]
    reconciler.on_task("ADDED", kube.put(TASKS, task_json()))
    event = kube.put(LEASES, lease(holder="agent-0/1"))
    reconciler.on_lease("ADDED", event, record.read(event))
    working(reconciler)
    wait_for(reconciler.queue.idle, timeout=10,
             message="the task reconciled")
    assert (reconciler.problem == "") is ready


# -- against the real API server --------------------------------------------------------------


def _events(kube: Kube, name: str) -> list[str]:
    return [e["reason"] for e in kube.list(EVENTS, field_selector=f"involvedObject.name={name}")["items"]]


def _phase(kube: Kube, name: str) -> str:
    return str((kube.get(TASKS, name).get("status") or {}).get("phase", ""))


def _bad_lease(kube: Kube, name: str, annotations: dict[str, str], *, holder: str = "", epoch: int = 0,
               state_label: str = "") -> None:
    task = kube.get(TASKS, name)
    body = record.encode(LeaseRecord(name=name, namespace=kube.namespace, queue=task["spec"]["queue"],
                                     owner_uid=task["metadata"]["uid"], holder=holder, epoch=epoch))
    body["metadata"]["annotations"] = annotations
    if state_label:
        body["metadata"]["labels"][record.LABEL_STATE] = state_label
    kube.create(LEASES, body)


def test_malformed_leases_stop_neither_a_loop_agent_nor_the_operator(
        cluster: Cluster, kube: Kube, namespace: str, chart_roles: dict[str, str], tmp_path: Path,
        operator: Operator) -> None:
    for name in ("bad-history", "nested", "unknown-outcome", "bad-time", "bad-state", "fine"):
        make_task(kube, name, queue="r")
    _bad_lease(kube, "bad-history", {record.ANN_HISTORY: "not json"})
    _bad_lease(kube, "bad-state", {}, state_label="weird")  # by hand: invisible to the agents' watch
    _bad_lease(kube, "nested", {record.ANN_HISTORY: NESTED})
    _bad_lease(kube, "unknown-outcome", {record.ANN_OUTCOME: "Exploded"})
    _bad_lease(kube, "bad-time", {record.ANN_NOT_BEFORE: "soon"})
    # Reported when the operator first sees them: an agent started sooner may claim one first,
    # and its claim writes the Lease anew.
    for name in ("bad-history", "nested", "unknown-outcome", "bad-time", "bad-state"):
        wait_for(lambda name=name: "MalformedLease" in _events(kube, name), timeout=30,  # type: ignore[misc]
                 message=f"the operator to report {name}'s Lease")
    config = agent_pod_kubeconfig(cluster, namespace, "looper-0", chart_roles["agent"], tmp_path)
    agent = Process(tasklease_cmd("run", f"--kubeconfig={config}", "--queue", "r", "--loop", "--", "echo", "ok"),
                    log=tmp_path / "agent.log", env={"POD_NAME": "looper-0"})
    names = ("bad-history", "nested", "unknown-outcome", "bad-time", "bad-state", "fine")
    try:
        try:
            wait_for(lambda: all(_phase(kube, n) == "Succeeded" for n in names), timeout=60,
                     message="every task of the queue done")
        except AssertionError as exc:
            phases = {n: _phase(kube, n) for n in names}
            raise AssertionError(f"{exc}: {phases}\nagent:\n{agent.output()[-3000:]}\n"
                                 f"operator:\n{operator.output()[-3000:]}") from None
        assert agent.proc.poll() is None, agent.output()[-3000:]  # still taking tasks
    finally:
        agent.stop()
    assert operator.metric("tasklease_malformed_objects_total") >= 4
    assert operator.get("/readyz")[0] == 200


def test_a_task_at_the_highest_epoch_is_dead_lettered_and_stops_no_agent(
        cluster: Cluster, kube: Kube, namespace: str, chart_roles: dict[str, str], tmp_path: Path,
        operator: Operator) -> None:
    """No claim can follow epoch 2^31 - 1 (leaseTransitions is an int32), whatever budget a
    retry granted; an attempt remembered above it was never handed out. Written by hand, such
    Leases neither stop an agent (a claim the API server refuses as invalid would) nor the queue."""
    for name in ("last-epoch", "beyond", "after"):
        make_task(kube, name, queue="e")
    _bad_lease(kube, "last-epoch", {record.ANN_BUDGET_FROM: str(record.MAX_EPOCH - 1)}, epoch=record.MAX_EPOCH)
    _bad_lease(kube, "beyond", {record.ANN_HISTORY: f'[{{"attempt":{record.MAX_EPOCH + 1},"holder":"a/b"}}]'})
    config = agent_pod_kubeconfig(cluster, namespace, "epochs-0", chart_roles["agent"], tmp_path)
    agent = Process(tasklease_cmd("run", f"--kubeconfig={config}", "--queue", "e", "--loop", "--", "echo", "ok"),
                    log=tmp_path / "agent.log", env={"POD_NAME": "epochs-0"})
    try:
        wait_for(lambda: [_phase(kube, n) for n in ("last-epoch", "beyond", "after")] == ["Failed", "Succeeded",
                                                                                        "Succeeded"],
                 timeout=60, message=f"the queue done\nagent:\n{agent.output()[-2000:]}")
        assert agent.proc.poll() is None, agent.output()[-3000:]  # still taking tasks
    finally:
        agent.stop()
    assert (kube.get(TASKS, "last-epoch")["status"]["reason"]) == "DeadLettered"
    assert "MalformedLease" in _events(kube, "beyond")


def test_a_task_claimed_before_whose_lease_was_deleted_is_done_by_a_loop_agent(
        cluster: Cluster, kube: Kube, namespace: str, chart_roles: dict[str, str], tmp_path: Path,
        operator: Operator) -> None:
    """Its Lease deleted by hand after a claim (here: a status that shows attempt 1, no Lease):
    loop agents skip a claimed task without a Lease, so the operator gives it a free one at the
    epoch its status shows, says so, and an agent does it at the next epoch."""
    task = make_task(kube, "unleased", queue="u", maxAttempts=3)
    task["status"] = {"phase": "Pending", "reason": "Requeued", "attempt": 1}
    kube.replace(TASKS, task, sub="status")
    config = agent_pod_kubeconfig(cluster, namespace, "unleased-0", chart_roles["agent"], tmp_path)
    agent = Process(tasklease_cmd("run", f"--kubeconfig={config}", "--queue", "u", "--loop", "--", "echo", "ok"),
                    log=tmp_path / "agent.log", env={"POD_NAME": "unleased-0"})
    try:
        wait_for(lambda: _phase(kube, "unleased") == "Succeeded", timeout=60,
                 message=f"the task done\nagent:\n{agent.output()[-2000:]}\noperator:\n{operator.output()[-2000:]}")
    finally:
        agent.stop()
    assert record.decode(kube.get(LEASES, "unleased")).epoch == 2
    assert "LeaseRecreated" in _events(kube, "unleased")


def test_a_claim_refused_for_what_its_lease_already_is_passes_that_task_over(
        cluster: Cluster, kube: Kube, namespace: str, chart_roles: dict[str, str], tmp_path: Path) -> None:
    """A Lease whose outcome the agent cannot read looks free to it, but the admission policy
    sees an outcome and refuses the claim: both claim paths pass that task over (no operator
    here to write the Lease back first) and claim the next."""
    make_task(kube, "exploded", queue="refused", priority=10)  # the best task: tried first
    _bad_lease(kube, "exploded", {record.ANN_OUTCOME: "Exploded"})
    make_task(kube, "fine-1", queue="refused")
    make_task(kube, "fine-2", queue="refused")
    config = agent_pod_kubeconfig(cluster, namespace, "refused-0", chart_roles["agent"], tmp_path)
    agent = Agent(Kube.connect(kubeconfig=str(config)), identity=Identity(pod="refused-0", instance="a"))
    try:
        first = agent.claim_once("refused")  # `tasklease claim`
        assert first.name.startswith("fine-")
        first.complete("ok")
        second = agent.claim("refused", timeout=30)  # a watching agent
        assert second.name.startswith("fine-") and second.name != first.name
        second.complete("ok")
        with pytest.raises(errors.NothingToClaim):
            agent.claim_once("refused")
        assert record.decode(kube.get(LEASES, "exploded")).holder == ""  # refused each time: never held
    finally:
        agent.close()


def test_a_result_too_long_for_the_status_is_cut_and_the_operator_stays_ready(
        kube: Kube, operator: Operator) -> None:
    make_task(kube, "long")
    make_task(kube, "other")
    _bad_lease(kube, "long", {record.ANN_OUTCOME: "Succeeded", record.ANN_REASON: "Completed" * 10,
                              record.ANN_RESULT: "x" * (models.MAX_RESULT_BYTES * 2)})
    status = wait_for(lambda: (s := kube.get(TASKS, "long").get("status") or {}).get("phase") == "Succeeded" and s,
                      timeout=20, message="the long result projected")
    assert len(status["result"]) == models.MAX_RESULT_BYTES and status["result"].endswith("...[cut]")
    assert len(status["reason"]) <= record.MAX_REASON_CHARS
    wait_for(lambda: "MalformedLease" in _events(kube, "long"), timeout=10, message="the Event")
    assert operator.get("/readyz")[0] == 200
    Protocol(kube).claim(TaskView.of(kube.get(TASKS, "other")), None, "other-0/1")  # the next task goes on as ever
    wait_for(lambda: _phase(kube, "other") == "Running", timeout=10, message="the next task projected")


def test_a_status_written_past_max_attempts_without_a_lease_is_dead_lettered_and_can_be_retried(
        kube: Kube, operator: Operator) -> None:
    """An attempt written into the status by hand, above maxAttempts, with no Lease behind it:
    the status remembers epochs (a Lease deleted by hand), so the attempts count and no claim
    is left. The operator dead-letters the task, says why, and leaves a Lease that remembers
    the epoch, so that `tasklease retry` grants a fresh budget from there."""
    task = make_task(kube, "overspent", maxAttempts=2)
    task["status"] = {"phase": "Pending", "reason": "Waiting", "attempt": 4}
    kube.replace(TASKS, task, sub="status")
    wait_for(lambda: _phase(kube, "overspent") == "Failed", timeout=20,
             message=f"the task dead-lettered\noperator:\n{operator.output()[-3000:]}")
    status = kube.get(TASKS, "overspent")["status"]
    assert (status["reason"], status["attempt"]) == ("DeadLettered", 4)
    assert "attempt 4" in status["lastError"]
    wait_for(lambda: "DeadLettered" in _events(kube, "overspent"), timeout=10, message="the Event")
    rec = record.decode(kube.get(LEASES, "overspent"))
    assert (rec.outcome, rec.epoch) == ("Failed", 4)
    protocol = Protocol(kube)
    protocol.retry(TaskView.of(kube.get(TASKS, "overspent")), rec)
    wait_for(lambda: _phase(kube, "overspent") == "Pending", timeout=10, message="the retry projected")
    held = protocol.claim(TaskView.of(kube.get(TASKS, "overspent")), protocol.read(namespace=kube.namespace,
                                                                                  name="overspent"), "p/1")
    assert held.epoch == 5

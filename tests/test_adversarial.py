"""Attacks on the protocol by a buggy or hostile agent, against the real API server with the
chart's RBAC and admission policy, as agents with tokens bound to their Pods (docs/security.md).

Each case makes one write that is well-formed in every respect but the one its check is
about, so that without that check the API server would accept it; the case asserts the
refusal and its message.
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import (AGENT_SA, Cluster, agent_pod_kubeconfig, make_queue, make_task, refusal,
                      service_account_kubeconfig, undone, wait_for)
from test_chart import CHART, _helm
from tasklease.agent import Agent, Identity
from tasklease.api import errors, models
from tasklease.api.timestamps import format_time, now_utc
from tasklease.kube import EVENTS, JSON, LEASES, NAMESPACES, PODS, TASKQUEUES, TASKS, Kube
from tasklease.operator.queues import PAUSE_GRACE_S
from tasklease.protocol import TaskView, members, policy, rate, record, slots
from tasklease.protocol.rules import claimed, ended
from tasklease.protocol.transitions import Held, Protocol

pytestmark = pytest.mark.adversarial


@dataclass
class Arena:
    """One namespace with two agent pods, alice and bob, and an admin; `unbound`: the agents'
    ServiceAccount with a token bound to no Pod (a stolen or hand-made one)."""

    admin: Kube
    alice: Kube
    bob: Kube
    unbound: Kube
    alice_holder: str
    bob_holder: str
    alice_uid: str
    namespace: str

    def task(self, queue: str = "q") -> TaskView:
        return TaskView.of(make_task(self.admin, f"t-{uuid.uuid4().hex[:8]}", queue=queue))

    def held(self, queue: str = "q") -> Held:
        """A task alice holds, claimed as an honest agent does."""
        view = self.task(queue)
        return Protocol(self.alice).claim(view, None, self.alice_holder)

    def free(self) -> record.LeaseRecord:
        """A Lease alice claimed and released: free, with a history."""
        held = self.held()
        return Protocol(self.alice).release(held).record

    def closed(self) -> record.LeaseRecord:
        held = self.held()
        return Protocol(self.alice).complete(held, "the real result").record

    def raw(self, name: str) -> JSON:
        return copy.deepcopy(self.admin.get(LEASES, name))


@pytest.fixture(scope="module")
def arena(cluster: Cluster, chart_roles: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Arena]:
    namespace = f"adv-{uuid.uuid4().hex[:8]}"
    root = cluster.kube()
    root.create(NAMESPACES, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    tmp = tmp_path_factory.mktemp("adversarial")
    admin = cluster.kube(namespace)
    kubes = {p: Kube.connect(kubeconfig=str(agent_pod_kubeconfig(cluster, namespace, p, chart_roles["agent"], tmp)))
             for p in ("alice", "bob")}
    uids = {p: admin.get(PODS, p)["metadata"]["uid"] for p in kubes}
    holders = {p: Identity(pod=p, instance="1", pod_uid=record.short_uid(uids[p])).holder for p in kubes}
    unbound = Kube.connect(kubeconfig=str(service_account_kubeconfig(cluster, namespace, AGENT_SA,
                                                                     chart_roles["agent"], tmp)))
    found = Arena(admin=admin, alice=kubes["alice"], bob=kubes["bob"], unbound=unbound, alice_holder=holders["alice"],
                  bob_holder=holders["bob"], alice_uid=uids["alice"], namespace=namespace)
    # The policy is loaded asynchronously, and the API server's caches learn the agents'
    # bindings and Pods: wait until a forged write is refused by the policy itself.
    probe = record.encode(record.LeaseRecord(name="probe", namespace=namespace, queue="q", owner_uid="x",
                                             holder="mallory/1", epoch=1))
    wait_for(lambda: "denied request" in refusal(lambda: found.bob.create(LEASES, probe)),
             timeout=30, message="the admission policy to be active")
    wait_for(lambda: "denied request" in refusal(lambda: _delete_probe(found)),
             timeout=30, message="the admission policy on deletes to be active")
    yield found
    root.delete(NAMESPACES, namespace)


def _delete_probe(arena: Arena) -> None:
    """An agent's delete of a Lease it may not delete (while the policy on deletes is not yet
    active, RBAC alone lets it through)."""
    if arena.admin.get_or_none(LEASES, "delete-probe") is None:
        arena.admin.create(LEASES, {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                                    "metadata": {"name": "delete-probe"}, "spec": {}})
    arena.bob.delete(LEASES, "delete-probe")


def refused(write: Callable[[], Any], message: str) -> None:
    why = refusal(write)
    assert why, "the write was accepted"
    assert "denied request" in why and message in why, why


def put(kube: Kube, rec: record.LeaseRecord, **change: Any) -> Callable[[], JSON]:
    """The write of `rec` changed by `change`, as a holder makes it (a PUT of the whole Lease)."""
    changed = replace(rec, **change)
    return lambda: kube.replace(LEASES, record.encode_replacement(changed))


def put_raw(kube: Kube, lease: JSON) -> Callable[[], JSON]:
    return lambda: kube.replace(LEASES, lease)


def create(kube: Kube, rec: record.LeaseRecord) -> Callable[[], JSON]:
    body = record.encode(rec)
    body["metadata"].pop("resourceVersion", None)
    return lambda: kube.create(LEASES, body)


def claim_of(arena: Arena, view: TaskView, claimer: str, **change: Any) -> record.LeaseRecord:
    """The record an honest claim by `claimer` creating `view`'s Lease would write, changed by `change`."""
    return replace(claimed(view, None, claimer, now_utc()), **change)


def attempt(n: int, holder: str, **fields: Any) -> models.Attempt:
    """An attempt as it would be written, even beyond the model's limits (as a hostile writer may)."""
    return models.Attempt.model_construct(attempt=n, holder=holder, claimed_at=now_utc(), **fields)


def test_a_token_bound_to_no_pod(arena: Arena) -> None:
    view = arena.task()
    refused(create(arena.unbound, claim_of(arena, view, "bob/1")), "must authenticate with a token bound to their Pod")


def test_naming_another_pods_uid_in_my_holder(arena: Arena) -> None:
    view = arena.task()
    posing = arena.bob_holder.rpartition("@")[0] + "@" + record.short_uid(arena.alice_uid)
    refused(create(arena.bob, claim_of(arena, view, posing)), "only name its own pod's uid")


# -- forged completions --------------------------------------------------------------------------


def test_creating_a_never_claimed_tasks_lease_already_closed(arena: Arena) -> None:
    view = arena.task(queue="other")
    forged = claim_of(arena, view, "", outcome="Succeeded", reason="Completed", result="forged", history=())
    refused(create(arena.bob, forged), "creates a task's Lease only to claim it")


def test_creating_a_lease_held_by_me_and_closed_at_once(arena: Arena) -> None:
    view = arena.task()
    forged = claim_of(arena, view, arena.bob_holder, outcome="Succeeded", reason="Completed", result="forged")
    refused(create(arena.bob, forged), "only to claim it")


def test_closing_a_free_lease(arena: Arena) -> None:
    free = arena.free()
    refused(put(arena.bob, free, outcome="Succeeded", reason="Completed", result="forged"),
            "a free lease accepts only a claim")


def test_failing_a_free_lease_for_good(arena: Arena) -> None:
    free = arena.free()
    refused(put(arena.bob, free, outcome="Failed", reason="Failed", error="sabotage"),
            "a free lease accepts only a claim")


def test_claiming_and_closing_a_free_lease_in_one_write(arena: Arena) -> None:
    free = arena.free()
    refused(put(arena.bob, free, holder=arena.bob_holder, epoch=free.epoch + 1, outcome="Succeeded",
                reason="Completed", result="forged"), "a free lease accepts only a claim")


def test_completing_another_pods_held_lease(arena: Arena) -> None:
    held = arena.held()
    refused(put(arena.bob, held.record, holder="", outcome="Succeeded", reason="Completed", result="forged"),
            "this lease is held by another pod")


def test_completing_at_another_epoch(arena: Arena) -> None:
    held = arena.held()
    refused(put(arena.alice, held.record, holder="", epoch=held.epoch + 1, outcome="Succeeded",
                reason="Completed", result="late"), "a holder ends its attempt at its own epoch")


# -- Leases without the protocol's labels, or not a task's at all -------------------------------


def test_a_label_less_lease_held_in_my_name(arena: Arena) -> None:
    view = arena.task()
    body = record.encode(claim_of(arena, view, arena.bob_holder))
    del body["metadata"]["labels"]
    refused(lambda: arena.bob.create(LEASES, body), "must carry the label app.kubernetes.io/managed-by=tasklease")


def test_a_label_less_lease_held_in_another_pods_name(arena: Arena) -> None:
    view = arena.task()
    body = record.encode(claim_of(arena, view, arena.alice_holder))
    del body["metadata"]["labels"]
    refused(lambda: arena.bob.create(LEASES, body), "only hold a lease in its own pod's name")


def test_a_label_less_lease_for_a_future_tasks_name(arena: Arena) -> None:
    body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": "future-task"},
            "spec": {"holderIdentity": arena.bob_holder, "leaseTransitions": 1}}
    refused(lambda: arena.bob.create(LEASES, body), "must carry the label app.kubernetes.io/managed-by")


def test_a_lease_owned_by_something_else_than_its_task(arena: Arena) -> None:
    view = arena.task()
    body = record.encode(claim_of(arena, view, arena.bob_holder))
    body["metadata"]["ownerReferences"][0].update(kind="ConfigMap", apiVersion="v1")
    refused(lambda: arena.bob.create(LEASES, body), "exactly one ownerReference")


def test_a_lease_owned_by_a_task_of_another_name(arena: Arena) -> None:
    view = arena.task()
    body = record.encode(claim_of(arena, view, arena.bob_holder))
    body["metadata"]["ownerReferences"][0]["name"] = "someone-else"
    refused(lambda: arena.bob.create(LEASES, body), "exactly one ownerReference")


# -- a holder that strips labels, or rewrites what it does not own -------------------------------


def test_stripping_the_managed_by_label(arena: Arena) -> None:
    held = arena.held()
    lease = arena.raw(held.name)
    del lease["metadata"]["labels"][record.LABEL_MANAGED]
    refused(put_raw(arena.alice, lease), "must carry the label app.kubernetes.io/managed-by")


def _stripped(lease: JSON) -> JSON:
    lease["metadata"]["labels"] = {}
    return lease


def test_stripping_every_label_then_handing_over(arena: Arena) -> None:
    lease = _stripped(arena.raw(arena.held().name))
    lease["spec"]["holderIdentity"] = arena.alice_holder.replace("/1@", "/2@")
    refused(put_raw(arena.alice, lease), "cannot hand its lease to another holder")


def test_stripping_every_label_then_lowering_the_epoch(arena: Arena) -> None:
    lease = _stripped(arena.raw(arena.held().name))
    lease["spec"]["leaseTransitions"] = 0
    refused(put_raw(arena.alice, lease), "never goes down")


def test_stripping_every_label_then_granting_myself_attempts(arena: Arena) -> None:
    held = arena.held()
    lease = _stripped(arena.raw(held.name))
    lease["metadata"]["annotations"][record.ANN_BUDGET_FROM] = str(held.epoch)
    refused(put_raw(arena.alice, lease), "cannot change tasklease.dev/budget-from")


def test_stripping_every_label_then_rewriting_a_closed_result(arena: Arena) -> None:
    lease = _stripped(arena.raw(arena.closed().name))
    lease["metadata"]["annotations"][record.ANN_RESULT] = "rewritten"
    refused(put_raw(arena.alice, lease), "a finished task never runs again")


def test_handing_the_lease_to_another_instance(arena: Arena) -> None:
    held = arena.held()
    refused(put(arena.alice, held.record, holder=arena.alice_holder.replace("/1@", "/2@")),
            "cannot hand its lease to another holder")


def test_handing_the_lease_to_another_pod(arena: Arena) -> None:
    held = arena.held()
    refused(put(arena.alice, held.record, holder=arena.bob_holder), "only hold a lease in its own pod's name")


def test_lowering_the_epoch(arena: Arena) -> None:
    held = arena.held()
    refused(put(arena.alice, held.record, epoch=0), "never goes down")


def test_granting_myself_attempts(arena: Arena) -> None:
    held = arena.held()
    refused(put(arena.alice, held.record, budget_from=held.epoch), "cannot change tasklease.dev/budget-from")


def test_rewriting_a_closed_result(arena: Arena) -> None:
    closed = arena.closed()
    refused(put(arena.alice, closed, result="rewritten"), "a finished task never runs again")


def test_reopening_a_closed_lease(arena: Arena) -> None:
    closed = arena.closed()
    refused(put(arena.alice, closed, outcome="", reason="", result="", holder=arena.alice_holder,
                epoch=closed.epoch + 1), "a finished task never runs again")


def test_pointing_the_owner_reference_at_a_made_up_uid(arena: Arena) -> None:
    held = arena.held()
    refused(put(arena.alice, held.record, owner_uid=str(uuid.uuid4())),
            "ownerReferences of a task's Lease cannot change")


def test_moving_the_lease_to_another_queue(arena: Arena) -> None:
    held = arena.held()
    refused(put(arena.alice, held.record, queue="elsewhere"), "tasklease.dev/queue cannot change")


def test_a_queue_label_that_names_no_queue(arena: Arena) -> None:
    view = arena.task()
    refused(create(arena.bob, claim_of(arena, view, arena.bob_holder, queue="Not_A_Queue")),
            "the label tasklease.dev/queue must name the Task's queue")


def test_claiming_with_a_state_label_that_hides_the_claim(arena: Arena) -> None:
    free = arena.free()
    lease = arena.raw(free.name)
    lease["spec"].update(holderIdentity=arena.bob_holder, leaseTransitions=free.epoch + 1)
    lease["metadata"]["labels"][record.LABEL_HOLDER_POD] = "bob"  # still says free: no agent's watch drops it
    refused(put_raw(arena.bob, lease), "the label tasklease.dev/state must say what the Lease is")


def test_a_holder_pod_label_naming_another_pod(arena: Arena) -> None:
    held = arena.held()
    lease = arena.raw(held.name)
    lease["metadata"]["labels"][record.LABEL_HOLDER_POD] = "bob"
    refused(put_raw(arena.alice, lease), "tasklease.dev/holder-pod must name the holder's pod")


def test_claiming_a_free_lease_with_the_epoch_jumped(arena: Arena) -> None:
    free = arena.free()
    refused(put(arena.bob, free, holder=arena.bob_holder, epoch=free.epoch + 5),
            "leaseTransitions one above the highest attempt")


def test_creating_a_claim_at_epoch_zero(arena: Arena) -> None:
    view = arena.task()
    refused(create(arena.bob, claim_of(arena, view, arena.bob_holder, epoch=0, history=())), "only to claim it")


@pytest.mark.parametrize(("carries", "message"), [
    ({"not_before": datetime(2999, 1, 1, tzinfo=UTC)}, "no outcome, reason, result, error, not-before or budget-from"),
    ({"error": "planted"}, "no outcome, reason, result, error, not-before or budget-from"),
    ({"budget_from": 1}, "an agent cannot change tasklease.dev/budget-from"),
], ids=["not-before", "error", "budget-from"])
def test_creating_a_claim_that_carries_what_only_an_ended_attempt_writes(
        arena: Arena, carries: dict[str, Any], message: str) -> None:
    # A not-before would hold the task back from every other agent once freed; an error would
    # show on the Task as the last attempt's; a budget-from would grant attempts.
    view = arena.task()
    refused(create(arena.bob, claim_of(arena, view, arena.bob_holder, **carries)), message)


# -- malformed and unbounded fields ---------------------------------------------------------------


def test_a_history_that_is_not_json(arena: Arena) -> None:
    held = arena.held()
    lease = arena.raw(held.name)
    lease["metadata"]["annotations"][record.ANN_HISTORY] = "not json ["
    refused(put_raw(arena.alice, lease), "tasklease.dev/history must be a JSON list")


def test_a_history_of_the_wrong_shape(arena: Arena) -> None:
    held = arena.held()
    lease = arena.raw(held.name)
    lease["metadata"]["annotations"][record.ANN_HISTORY] = json.dumps([{"attempt": "one", "holder": 7}])
    refused(put_raw(arena.alice, lease), "tasklease.dev/history must be a JSON list")


def test_a_history_longer_than_the_status_keeps(arena: Arena) -> None:
    held = arena.held()
    history = tuple(attempt(1, arena.alice_holder, outcome="Released") for _ in range(models.MAX_HISTORY + 1))
    refused(put(arena.alice, held.record, history=history), f"at most {models.MAX_HISTORY} attempts")


@pytest.mark.parametrize("field", ["holder", "outcome", "message"])
def test_a_history_field_longer_than_the_status_allows(arena: Arena, field: str) -> None:
    held = arena.held()
    limit = models.Attempt.model_fields[field].metadata
    longest = next(m.max_length for m in limit if getattr(m, "max_length", None) is not None)
    fields = {"holder": arena.alice_holder, field: "x" * (longest + 1)}
    long = attempt(held.epoch, **fields)
    refused(put(arena.alice, held.record, history=(long,)), "does not fit Task.status.history")


def test_a_history_time_that_is_no_rfc3339_time(arena: Arena) -> None:
    held = arena.held()
    lease = arena.raw(held.name)
    entries = json.loads(lease["metadata"]["annotations"][record.ANN_HISTORY])
    entries[-1]["claimedAt"] = "yesterday"
    lease["metadata"]["annotations"][record.ANN_HISTORY] = json.dumps(entries, separators=(",", ":"))
    refused(put_raw(arena.alice, lease), "times in RFC 3339")


def test_a_history_naming_an_attempt_above_the_epoch(arena: Arena) -> None:
    held = arena.held()
    refused(put(arena.alice, held.record, history=(attempt(held.epoch + 50, arena.alice_holder),)),
            "cannot name an attempt above leaseTransitions")


def test_an_unknown_outcome(arena: Arena) -> None:
    held = arena.held()
    refused(put(arena.alice, held.record, holder="", outcome="Exploded", reason="Failed"), "unknown outcome")


def test_an_agent_cannot_close_as_cancelled(arena: Arena) -> None:
    held = arena.held()
    refused(put(arena.alice, held.record, holder="", outcome="Cancelled", reason="Failed"), "unknown outcome")


def test_a_reason_that_does_not_go_with_the_outcome(arena: Arena) -> None:
    held = arena.held()
    refused(put(arena.alice, held.record, holder="", outcome="Succeeded", reason="DeadlineExceeded", result="x"),
            "tasklease.dev/reason must go with the outcome")


def test_a_result_longer_than_the_status_allows(arena: Arena) -> None:
    held = arena.held()
    refused(put(arena.alice, held.record, holder="", outcome="Succeeded", reason="Completed",
                result="r" * (models.MAX_RESULT_BYTES + 1)), "longer than Task.status.result allows")


def test_a_result_without_a_success(arena: Arena) -> None:
    held = arena.held()
    refused(put(arena.alice, held.record, holder="", outcome="Failed", reason="Failed", result="half done"),
            "only a close as Succeeded carries a result")


def test_an_error_longer_than_the_status_allows(arena: Arena) -> None:
    held = arena.held()
    refused(put(arena.alice, held.record, holder="", error="e" * (models.MAX_ERROR_CHARS + 1)),
            "longer than Task.status.lastError allows")


def test_a_holder_longer_than_the_status_allows(arena: Arena) -> None:
    view = arena.task()
    holder = "bob/" + "i" * 600
    refused(create(arena.bob, claim_of(arena, view, arena.bob_holder, holder=holder, history=())),
            "longer than Task.status.holder allows")


def test_a_not_before_that_is_no_time(arena: Arena) -> None:
    held = arena.held()
    lease = arena.raw(held.name)
    lease["spec"]["holderIdentity"] = None
    lease["metadata"]["labels"][record.LABEL_STATE] = record.FREE
    del lease["metadata"]["labels"][record.LABEL_HOLDER_POD]
    lease["metadata"]["annotations"][record.ANN_NOT_BEFORE] = "tomorrow"
    refused(put_raw(arena.alice, lease), "tasklease.dev/not-before is an RFC 3339 time")


def test_a_lease_duration_beyond_a_tasks_bounds(arena: Arena) -> None:
    held = arena.held()
    refused(put(arena.alice, held.record, duration_s=86_400), "leaseDurationSeconds must be within")


# -- member Leases --------------------------------------------------------------------------------


def member_body(arena: Arena, holder: str, *, queue: str = "q", owner: tuple[str, str] | None = None,
                took: str = "[]", duration: int = members.DURATION_S, name: str | None = None,
                holding: str = "0") -> JSON:
    meta: JSON = {"name": name or members.lease_name(queue, holder),
                  "labels": {members.LABEL_AGENT_OF: queue},
                  "annotations": {members.ANN_TOOK: took, members.ANN_HOLDING: holding,
                                  members.ANN_CLAIMING: "true"}}
    if owner:
        meta["ownerReferences"] = [{"apiVersion": "v1", "kind": "Pod", "name": owner[0], "uid": owner[1]}]
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta,
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": duration}}


def test_a_member_lease_of_another_agent(arena: Arena) -> None:
    body = member_body(arena, arena.alice_holder, took=json.dumps(["a", "b"]))
    refused(lambda: arena.bob.create(LEASES, body), "only hold a lease in its own pod's name")


def test_a_member_lease_owned_by_another_pod(arena: Arena) -> None:
    body = member_body(arena, arena.bob_holder, owner=("alice", arena.alice_uid))
    refused(lambda: arena.bob.create(LEASES, body), "owned by the agent's own Pod")


def test_a_member_lease_that_lives_for_a_day(arena: Arena) -> None:
    body = member_body(arena, arena.bob_holder, duration=86_400)
    refused(lambda: arena.bob.create(LEASES, body), f"leaseDurationSeconds is {members.DURATION_S}")


def test_a_member_lease_that_took_every_task(arena: Arena) -> None:
    took = json.dumps([f"task-{i}" for i in range(policy.MAX_TOLD + 1)])
    refused(lambda: arena.bob.create(LEASES, member_body(arena, arena.bob_holder, took=took)),
            "must be a JSON list of at most")


def test_a_member_lease_with_unreadable_took(arena: Arena) -> None:
    body = member_body(arena, arena.bob_holder, took="everything")
    refused(lambda: arena.bob.create(LEASES, body), "must be a JSON list of at most")


def test_a_member_lease_with_a_made_up_count(arena: Arena) -> None:
    body = member_body(arena, arena.bob_holder, holding="lots")
    refused(lambda: arena.bob.create(LEASES, body), "tasklease.dev/holding must be a count")


def test_a_member_lease_named_like_a_task(arena: Arena) -> None:
    body = member_body(arena, arena.bob_holder, name="future-task")
    refused(lambda: arena.bob.create(LEASES, body), "a member Lease is named tasklease-agent.")


def test_a_member_lease_posing_as_a_task_lease(arena: Arena) -> None:
    body = member_body(arena, arena.bob_holder)
    body["metadata"]["labels"][record.LABEL_MANAGED] = "tasklease"
    refused(lambda: arena.bob.create(LEASES, body), "a member Lease cannot carry app.kubernetes.io/managed-by")


def test_a_member_lease_of_no_queue(arena: Arena) -> None:
    body = member_body(arena, arena.bob_holder, queue="Not_A_Queue")
    refused(lambda: arena.bob.create(LEASES, body), "the label tasklease.dev/agent-of must name a queue")


def test_a_member_lease_that_says_maybe(arena: Arena) -> None:
    body = member_body(arena, arena.bob_holder)
    body["metadata"]["annotations"][members.ANN_CLAIMING] = "maybe"
    refused(lambda: arena.bob.create(LEASES, body), "tasklease.dev/claiming must be true or false")
    body = member_body(arena, arena.bob_holder)
    body["metadata"]["annotations"][members.ANN_WAITING] = "for ever"
    refused(lambda: arena.bob.create(LEASES, body), "tasklease.dev/waiting must be true or false")


def test_a_member_lease_that_drops_its_pod(arena: Arena) -> None:
    pod = arena.admin.get(PODS, "bob")["metadata"]
    written = arena.bob.create(LEASES, member_body(arena, arena.bob_holder, queue="dropped",
                                                   owner=(pod["name"], pod["uid"])))
    del written["metadata"]["ownerReferences"]  # it would outlive its Pod
    refused(put_raw(arena.bob, written), "the ownerReferences of a member Lease cannot change")


def test_writing_another_agents_member_lease(arena: Arena) -> None:
    written = arena.alice.create(LEASES, member_body(arena, arena.alice_holder))
    written["spec"]["holderIdentity"] = arena.bob_holder
    refused(put_raw(arena.bob, written), "this lease is held by another pod")


def test_moving_a_member_lease_to_another_queue(arena: Arena) -> None:
    written = arena.alice.create(LEASES, member_body(arena, arena.alice_holder, queue="mine"))
    written["metadata"]["labels"][members.LABEL_AGENT_OF] = "theirs"
    refused(put_raw(arena.alice, written), "the label tasklease.dev/agent-of cannot change")


def test_deleting_a_tasks_lease_i_hold(arena: Arena) -> None:
    held = arena.held()
    refused(lambda: arena.alice.delete(LEASES, held.record.name), "a task's Lease is never deleted")
    assert arena.admin.get_or_none(LEASES, held.record.name) is not None


def test_deleting_a_closed_tasks_lease(arena: Arena) -> None:
    rec = arena.closed()
    refused(lambda: arena.alice.delete(LEASES, rec.name), "a task's Lease is never deleted")


def test_deleting_a_lease_named_and_labelled_as_a_member_but_of_a_task(arena: Arena) -> None:
    body = member_body(arena, arena.alice_holder, queue="posing")
    body["metadata"]["labels"][record.LABEL_MANAGED] = "tasklease"
    arena.admin.create(LEASES, body)  # written by someone trusted: no agent may write it so
    refused(lambda: arena.alice.delete(LEASES, body["metadata"]["name"]), "a task's Lease is never deleted")


def test_deleting_another_agents_member_lease(arena: Arena) -> None:
    written = arena.alice.create(LEASES, member_body(arena, arena.alice_holder, queue="others",
                                                     owner=("alice", arena.alice_uid)))
    refused(lambda: arena.bob.delete(LEASES, written["metadata"]["name"]), "deletes only its own member Lease")
    assert arena.admin.get_or_none(LEASES, written["metadata"]["name"]) is not None


def test_deleting_another_agents_member_lease_once_it_left(arena: Arena) -> None:
    written = arena.alice.create(LEASES, member_body(arena, arena.alice_holder, queue="gone",
                                                     owner=("alice", arena.alice_uid)))
    written["spec"]["holderIdentity"] = None
    left = arena.alice.replace(LEASES, written)
    refused(lambda: arena.bob.delete(LEASES, left["metadata"]["name"]), "owned by its own Pod")
    arena.alice.delete(LEASES, left["metadata"]["name"])  # its own agent may: its Pod owns it


def test_deleting_the_operators_election_lease(arena: Arena) -> None:
    if arena.admin.get_or_none(LEASES, policy.ELECTION_LEASE, namespace="default") is None:
        arena.admin.create(LEASES, {
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": policy.ELECTION_LEASE, "namespace": "default"},
            "spec": {"holderIdentity": "", "leaseDurationSeconds": 15}}, namespace="default")
    refused(lambda: arena.bob.delete(LEASES, policy.ELECTION_LEASE, namespace="default"),
            "an agent deletes only its own member Lease")


def test_deleting_with_a_token_bound_to_no_pod(arena: Arena) -> None:
    written = arena.bob.create(LEASES, member_body(arena, arena.bob_holder, queue="unbound"))
    refused(lambda: arena.unbound.delete(LEASES, written["metadata"]["name"]), "a token bound to their Pod")


def test_an_honest_agent_still_joins_claims_and_finishes(arena: Arena) -> None:
    """The other side of every case above: what an honest agent writes passes (claim by create
    and by patch, renew, release, fail, complete, and its member Lease, deleted when it leaves)."""
    make_task(arena.admin, "honest", queue="honest")
    agent = Agent(arena.bob, identity=Identity(pod="bob", instance="1"))
    try:
        first = agent.claim("honest", timeout=30)
        Protocol(arena.bob).renew(first.held)
        first.fail("once more")
        make_task(arena.admin, "honest-2", queue="honest")
        second = agent.claim("honest", timeout=30)
        second.complete("done")
    finally:
        agent.close()
    assert record.decode(arena.raw(second.name)).result == "done"
    # It left its queue: its member Lease, its own, is deleted.
    assert arena.admin.get_or_none(LEASES, members.lease_name("honest", agent.identity.holder)) is None


# -- the operator's election Lease ----------------------------------------------------------------


def test_an_agent_cannot_create_the_operators_election_lease(arena: Arena) -> None:
    # The chart is rendered for the namespace "default" (conftest's `helm template`); the
    # agents' test binding reaches every namespace, as agents sharing the operator's would.
    body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": policy.ELECTION_LEASE},
            "spec": {"holderIdentity": arena.bob_holder, "leaseDurationSeconds": 15}}
    refused(lambda: arena.bob.create(LEASES, body, namespace="default"), "the operator's election Lease")


def test_an_agent_cannot_take_the_operators_election_lease(arena: Arena) -> None:
    current = arena.admin.get_or_none(LEASES, policy.ELECTION_LEASE, namespace="default")
    if current is None:
        current = arena.admin.create(LEASES, {
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": policy.ELECTION_LEASE, "namespace": "default"},
            "spec": {"holderIdentity": "", "leaseDurationSeconds": 15}}, namespace="default")
    current["spec"]["holderIdentity"] = arena.bob_holder
    refused(put_raw(arena.bob, current), "the operator's election Lease")
    assert arena.admin.get(LEASES, policy.ELECTION_LEASE, namespace="default")["spec"].get("holderIdentity") != \
        arena.bob_holder


def test_the_policy_names_the_operators_election_lease() -> None:
    from tasklease.operator.leader import ElectionConfig
    assert ElectionConfig(namespace="any").name == policy.ELECTION_LEASE


def test_the_time_pattern_accepts_what_every_writer_writes() -> None:
    import re
    from tasklease.api.timestamps import format_time
    sample = format_time(now_utc())
    assert sample is not None and re.fullmatch(policy._TIME, sample)
    assert re.fullmatch(policy._TIME, models.Attempt(attempt=1, holder="h", claimed_at=now_utc())
                        .model_dump(mode="json", by_alias=True)["claimedAt"])


def test_a_forged_lease_of_a_task_is_replaced_by_the_tasks_own_free_one(
        cluster: Cluster, kube: Kube, namespace: str, chart_roles: dict[str, str], tmp_path: Path,
        operator: Any) -> None:
    """A claim the policy cannot judge (its owner uid is made up) is a Lease of another task to
    the operator: it removes it, and since an agent whose claim lost to it counts the task as
    taken until it sees the task's Lease free, it gives the task its own Lease, free, at the
    task's epoch (not the forgery's), and says so. An agent then claims it."""
    task = make_task(kube, "forged", queue="q")
    mallory, holder = _mallory(cluster, kube, namespace, chart_roles, tmp_path)
    forgery = record.LeaseRecord(name="forged", namespace=namespace, queue="q", owner_uid=str(uuid.uuid4()),
                                 holder=holder, epoch=40, history=(attempt(40, holder),))
    wait_for(lambda: refusal(create(mallory, forgery)) == "", timeout=30, message="mallory's claim to be judged")

    def own_and_free() -> bool:
        lease = kube.get_or_none(LEASES, "forged")
        rec = record.decode(lease) if lease is not None else None
        return rec is not None and (rec.owner_uid, rec.state, rec.epoch) == (task["metadata"]["uid"], record.FREE, 0)
    wait_for(own_and_free, timeout=30, message="the task's own free Lease in place of the forgery")
    # The Event is posted after the write that the wait above saw.
    wait_for(lambda: "LeaseRecreated" in [e["reason"] for e in kube.list(
        EVENTS, field_selector="involvedObject.name=forged")["items"]], timeout=30, message="the LeaseRecreated Event")
    honest = Agent(cluster.kube(namespace), identity=Identity(pod="honest", instance="1"))
    try:
        claimed_task = honest.claim("q", timeout=60)
        assert claimed_task.epoch == 1
        claimed_task.complete("ran")
    finally:
        honest.close()


def test_a_claim_created_in_another_queue_is_put_back_in_its_tasks_queue(
        cluster: Cluster, kube: Kube, namespace: str, chart_roles: dict[str, str], tmp_path: Path,
        operator: Any) -> None:
    """The policy cannot read the Task's queue, so a creating claim may name another queue's:
    the operator labels the Lease with its Task's queue again, where that queue's agents look."""
    mallory, holder = _mallory(cluster, kube, namespace, chart_roles, tmp_path)
    view = TaskView.of(make_task(kube, "misfiled", queue="q"))
    misfiled = replace(claimed(view, None, holder, now_utc()), queue="elsewhere")
    wait_for(lambda: refusal(create(mallory, misfiled)) == "", timeout=30, message="mallory's claim to be judged")
    wait_for(lambda: record.decode(kube.get(LEASES, "misfiled")).queue == "q", timeout=60,
             message="the Lease labelled with its task's queue")


# -- queue controls the policy cannot count: kept by the operator (docs/security.md) ------------------


def _mallory(cluster: Cluster, kube: Kube, namespace: str, chart_roles: dict[str, str],
             tmp_path: Path) -> tuple[Kube, str]:
    """A hostile agent Pod of the test's namespace: its client (a token bound to its Pod) and holder."""
    mallory = Kube.connect(kubeconfig=str(agent_pod_kubeconfig(cluster, namespace, "mallory", chart_roles["agent"],
                                                               tmp_path)))
    uid = kube.get(PODS, "mallory")["metadata"]["uid"]
    return mallory, Identity(pod="mallory", instance="1", pod_uid=record.short_uid(uid)).holder


def test_a_claim_labelled_with_another_queue_still_obeys_its_own_queues_controls(
        cluster: Cluster, kube: Kube, namespace: str, chart_roles: dict[str, str], tmp_path: Path,
        operator: Any) -> None:
    """Claims created with another queue's label, in a paused queue and in one whose
    maxRunning they hold no slot of, are undone once the operator has put them back in their
    tasks' queues."""
    mallory, holder = _mallory(cluster, kube, namespace, chart_roles, tmp_path)
    make_queue(kube, "stopped", paused=True)
    make_queue(kube, "guarded", maxRunning=1)
    views = [TaskView.of(make_task(kube, name, queue=queue)) for name, queue in (("s-1", "stopped"),
                                                                                  ("g-1", "guarded"))]
    wait_for(lambda: kube.get(TASKQUEUES, "stopped").get("status", {}).get("observedGeneration"),
             message="the operator to see the paused queue")
    time.sleep(PAUSE_GRACE_S)  # a claim within the grace after the pause may have been in flight: tolerated
    for view in views:
        write = create(mallory, replace(claimed(view, None, holder, now_utc()), queue="elsewhere"))
        wait_for(lambda w=write: refusal(w) == "", timeout=30, message="mallory's claim to be judged")
    wait_for(lambda: undone(kube, "s-1"), timeout=30, message="the claim in the paused queue undone")
    wait_for(lambda: undone(kube, "g-1"), timeout=60, message="the claim without a slot undone")


def test_slots_numbered_above_max_running_cover_no_claim(
        cluster: Cluster, kube: Kube, namespace: str, chart_roles: dict[str, str], tmp_path: Path,
        operator: Any) -> None:
    """The policy accepts any slot number (it cannot read the limit): slots 7 and 8 of a queue
    whose maxRunning is 1 cover none of their holder's claims."""
    mallory, holder = _mallory(cluster, kube, namespace, chart_roles, tmp_path)
    make_queue(kube, "limited", maxRunning=1)
    names = [f"l-{i}" for i in range(3)]
    for name in names:
        make_task(kube, name, queue="limited")
    assert slots.acquire(mallory, [], namespace=namespace, queue="limited", holder=holder, limit=1) is not None
    for index in (7, 8):
        mallory.create(LEASES, slots._body(mallory, "limited", index, holder))
    for name in names:
        Protocol(mallory).claim(TaskView.of(kube.get(TASKS, name)), None, holder)
    wait_for(lambda: sum(undone(kube, n) for n in names) == 2, timeout=60,
             message="every claim but the one under slot 0 undone")
    assert record.decode(kube.get(LEASES, "l-0")).holder == holder  # the oldest: the newest go first



@pytest.mark.parametrize(("change", "message"), [
    ({"labels": {record.LABEL_MANAGED: "tasklease"}}, "a slot Lease is no task's Lease and no member Lease"),
    ({"labels": {members.LABEL_AGENT_OF: "q"}}, "a member Lease is named tasklease-agent."),
    ({"ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "bob", "uid": str(uuid.uuid4())}]},
     "a slot Lease has no ownerReferences"),
    ({"leaseDurationSeconds": slots.DURATION_S + 1}, f"a slot Lease's leaseDurationSeconds is {slots.DURATION_S}"),
], ids=["managed-by", "agent-of", "owner", "duration"])
def test_a_slot_lease_that_is_more_than_a_slot(arena: Arena, change: dict[str, Any], message: str) -> None:
    # A task's or a member's label would have the operator or the agents read the slot as one of
    # those; an owner could have the garbage collector delete it under its holder; a longer
    # duration would keep it from the operator's freeing of a dead agent's slot for longer.
    body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": slots.slot_name("q", 0), "labels": {slots.LABEL_SLOT_OF: "q"}},
            "spec": {"holderIdentity": arena.bob_holder, "leaseDurationSeconds": slots.DURATION_S}}
    body["metadata"]["labels"].update(change.get("labels", {}))
    if "ownerReferences" in change:
        body["metadata"]["ownerReferences"] = change["ownerReferences"]
    if "leaseDurationSeconds" in change:
        body["spec"]["leaseDurationSeconds"] = change["leaseDurationSeconds"]
    refused(lambda: arena.bob.create(LEASES, body), message)

def test_a_rate_bucket_time_that_is_no_time(
        cluster: Cluster, kube: Kube, namespace: str, chart_roles: dict[str, str], tmp_path: Path) -> None:
    """The policy refuses a claim-rate bucket whose next-claim time is no time, and an honest
    agent reading one all the same (written past the policy, say before it was installed)
    takes it as now: no write of the bucket stops a claim."""
    mallory, _ = _mallory(cluster, kube, namespace, chart_roles, tmp_path)
    make_queue(kube, "rated", claimsPerSecond=5)
    bucket = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
              "metadata": {"name": rate.lease_name("rated"), "labels": {slots.LABEL_SLOT_OF: "rated"},
                           "annotations": {rate.ANN_NEXT: "not-a-time"}},
              "spec": {"leaseDurationSeconds": slots.DURATION_S}}
    wait_for(lambda: "denied request" in refusal(lambda: mallory.create(LEASES, bucket)), timeout=30,
             message="the admission policy to be active")
    assert f"{rate.ANN_NEXT} is an RFC 3339 time" in refusal(lambda: mallory.create(LEASES, bucket))
    kube.create(LEASES, bucket)  # as an admin, past the agents' policy
    make_task(kube, "r-1", queue="rated")
    with Agent(cluster.kube(namespace), identity=Identity(pod="honest", instance="1")) as agent:
        agent.claim("rated", timeout=30).complete("ran")
    assert rate.arrival(kube.get(LEASES, rate.lease_name("rated"))["metadata"]["annotations"][rate.ANN_NEXT])


def test_a_release_that_puts_its_task_off_for_centuries(
        cluster: Cluster, kube: Kube, namespace: str, chart_roles: dict[str, str], tmp_path: Path,
        operator: Any) -> None:
    """A holder may free its task with any not-before (the policy has no clock, and cannot read
    the Task's backoff); the operator cuts it to one backoff from when it saw the Lease free."""
    mallory, holder = _mallory(cluster, kube, namespace, chart_roles, tmp_path)
    view = TaskView.of(make_task(kube, "later", queue="q", backoff={"initialSeconds": 1, "maxSeconds": 2}))
    held = Protocol(mallory).claim(view, None, holder)
    far = datetime(2999, 1, 1, tzinfo=UTC)
    freed = ended(held.record, outcome="Released", now=now_utc(), message="see you", not_before=far)
    mallory.replace(LEASES, record.encode_replacement(freed))
    wait_for(lambda: (record.decode(kube.get(LEASES, "later")).not_before or far) < far, timeout=30,
             message="the operator to cut the not-before")
    with Agent(cluster.kube(namespace), identity=Identity(pod="honest", instance="1")) as agent:
        task = agent.claim("q", timeout=30)
        task.complete("ran")
    assert task.name == "later"


# -- pod-bound leases (docs/pod-bound.md): only one's own Pod; the operator only renews ---------------

RENEW_RELEASE = "tasklease"  # its operator ServiceAccount is tasklease-operator, as the suite's operators'


@pytest.fixture
def renew_policy(cluster: Cluster, arena: Arena, chart_roles: dict[str, str], tmp_path: Path) -> Iterator[Kube]:
    """The chart's operator-renew policy for the operator ServiceAccount of the arena's namespace,
    and a client with that ServiceAccount's token and the chart's operator rights."""
    done = _helm("template", RENEW_RELEASE, str(CHART), "-n", arena.namespace)
    assert done.returncode == 0, done.stderr
    docs = [d for d in yaml.safe_load_all(done.stdout) if d and d["kind"].startswith("ValidatingAdmissionPolicy")
            and d["metadata"]["name"] == f"{RENEW_RELEASE}-operator-renew"]
    assert len(docs) == 2
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
    operator = Kube.connect(kubeconfig=str(service_account_kubeconfig(
        cluster, arena.namespace, f"{RENEW_RELEASE}-operator", chart_roles["operator"], tmp_path)))
    try:
        yield operator
    finally:
        cluster.kubectl("delete", "validatingadmissionpolicy,validatingadmissionpolicybinding",
                        f"{RENEW_RELEASE}-operator-renew", "--ignore-not-found")


def _bound(arena: Arena) -> record.LeaseRecord:
    """A task alice holds, bound to her own Pod as `tasklease claim --pod-bound` binds it."""
    protocol = Protocol(arena.alice)
    return protocol.bind_to_pod(arena.held(), arena.alice_uid).record


# -- the agents' policy: only one's own Pod ------------------------------------------------------------


def test_an_agent_binds_a_lease_to_its_own_pod(arena: Arena) -> None:
    rec = _bound(arena)
    assert rec.pod_bound == arena.alice_uid
    assert arena.raw(rec.name)["metadata"]["annotations"][record.ANN_POD_BOUND] == arena.alice_uid


def test_binding_my_lease_to_another_agents_pod(arena: Arena) -> None:
    """Else a dead agent's lease would live on as long as a long-lived peer's Pod."""
    bob_uid = arena.admin.get(PODS, "bob")["metadata"]["uid"]
    held = arena.held()
    refused(put(arena.alice, held.record, pod_bound=bob_uid), "must name the uid of the agent's own Pod")
    refused(put(arena.alice, held.record, pod_bound="made-up"), "must name the uid of the agent's own Pod")


def test_a_binding_kept_by_a_lease_its_holder_ends(arena: Arena) -> None:
    rec = _bound(arena)
    body = record.encode_replacement(ended(rec, outcome="Released", now=now_utc()))
    body["metadata"]["annotations"][record.ANN_POD_BOUND] = arena.alice_uid
    refused(put_raw(arena.alice, body), "only on a held lease")


# -- the operator's policy: renew, and only renew ---------------------------------------------------


def _policy_bites(operator: Kube, arena: Arena) -> None:
    """The renew policy is loaded asynchronously: wait until it refuses a forged handover."""
    def refusal() -> str:
        rec = _bound(arena)
        try:
            operator.merge_patch(LEASES, rec.name, {"spec": {"leaseDurationSeconds": 60}}, namespace=arena.namespace)
        except errors.TaskleaseError as exc:
            return str(exc)
        return ""
    wait_for(lambda: "the operator only renews" in refusal(), timeout=30, message="the operator-renew policy")


def test_the_operator_renews_a_bound_lease_and_changes_nothing_else(renew_policy: Kube, arena: Arena) -> None:
    operator = renew_policy
    _policy_bites(operator, arena)
    rec = _bound(arena)
    renewed = Protocol(operator).keep_alive(rec)
    assert renewed.resource_version != rec.resource_version and renewed.renewed_at != rec.renewed_at
    assert (renewed.holder, renewed.epoch, renewed.pod_bound) == (rec.holder, rec.epoch, rec.pod_bound)
    for change, value in (("holderIdentity", arena.bob_holder), ("leaseTransitions", rec.epoch + 1),
                          ("leaseDurationSeconds", 3600), ("acquireTime", format_time(now_utc()))):
        with pytest.raises(errors.TaskleaseError, match="the operator only renews a pod-bound lease"):
            operator.merge_patch(LEASES, rec.name, {"metadata": {"resourceVersion": renewed.resource_version},
                                                    "spec": {change: value}}, namespace=arena.namespace)
    with pytest.raises(errors.TaskleaseError, match="the operator only renews a pod-bound lease"):
        operator.merge_patch(LEASES, rec.name, {"metadata": {"annotations": {record.ANN_POD_BOUND: "other"}}},
                             namespace=arena.namespace)
    # The holder keeps the right to end its attempt after the operator's renewal.
    held = Protocol(arena.alice).adopt(arena.namespace, rec.name, holder=rec.holder, epoch=rec.epoch)
    done = Protocol(arena.alice).complete(replace(held, record=rec), "done")  # a stale version: re-read, still ours
    assert done.record.outcome == "Succeeded"
    assert record.ANN_POD_BOUND not in arena.raw(rec.name)["metadata"]["annotations"]


def test_the_operator_may_still_end_a_bound_attempt(renew_policy: Kube, arena: Arena) -> None:
    operator = renew_policy
    _policy_bites(operator, arena)
    rec = _bound(arena)
    view = arena.task()  # any Task's spec will do for the backoff
    expired = Protocol(operator).expire(replace(view, name=rec.name), rec, message="its pod went")
    assert expired.state == record.FREE and expired.pod_bound == ""

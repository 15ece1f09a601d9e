"""The chart's admission policy: the API server itself refuses protocol violations from agents."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from test_chart import render  # the chart as `helm template` renders it offline
from conftest import (AGENT_SA, ROOT, Cluster, agent_pod_kubeconfig, make_task, refusal, service_account_kubeconfig,
                      wait_for)
from tasklease.api import errors
from tasklease.protocol import record
from tasklease.agent import Agent, Identity
from tasklease.api.timestamps import now_utc
from tasklease.kube import LEASES, PODS, TASKS, Kube
from tasklease.protocol import TaskView, policy
from tasklease.protocol.rules import Blocker, blocker

def _agent_pod(cluster: Cluster, namespace: str, name: str, role: str, tmp_path: Path) -> Kube:
    return Kube.connect(kubeconfig=str(agent_pod_kubeconfig(cluster, namespace, name, role, tmp_path)))


def _patch(kube: Kube, lease: dict[str, Any]) -> None:
    """A hand-made write as an agent may send it: a merge patch of what it read."""
    kube.merge_patch(LEASES, lease["metadata"]["name"], lease)


def _refused(write: Any, message: str, *, standing: bool = False) -> None:
    """Refused with `message`: for what the Lease already is (`standing`: a 403 a claim passes
    over), or for what was written or who wrote it (a 422 that ends a claim)."""
    with pytest.raises(errors.Invalid) as refused:
        write()
    assert message in str(refused.value), str(refused.value)
    assert isinstance(refused.value, errors.Refused) is standing, repr(refused.value)


def test_agents_cannot_break_the_protocol_even_by_hand(
        cluster: Cluster, kube: Kube, namespace: str, chart_roles: dict[str, str], tmp_path: Path) -> None:
    make_task(kube, "guarded", queue="g")
    alice_kube = _agent_pod(cluster, namespace, "alice", chart_roles["agent"], tmp_path)
    bob_kube = _agent_pod(cluster, namespace, "bob", chart_roles["agent"], tmp_path)
    alice = Agent(alice_kube, identity=Identity(pod="alice", instance="1"))

    # The policy is type-checked and loaded asynchronously: wait until it bites.
    forged = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
              "metadata": {"name": "probe", "labels": {record.LABEL_MANAGED: "tasklease"}},
              "spec": {"holderIdentity": "mallory/1", "leaseTransitions": 1}}
    # Refused by the policy itself: until the API server's caches have the agents' Role
    # binding and Pods, the probe is refused as Forbidden or Unauthorized, policy or not.
    wait_for(lambda: "may only hold a lease in its own pod's name" in refusal(lambda: bob_kube.create(LEASES, forged)),
             timeout=30, message="the admission policy to be active")
    # The policy on deletes likewise (until it bites, RBAC alone lets a delete through).
    wait_for(lambda: "never deleted" in refusal(lambda: _delete_probe(kube, bob_kube)),
             timeout=30, message="the admission policy on deletes to be active")

    # Case by case against the one claimability rule: what the policy lets an agent claim
    # (a free Lease) and what it refuses (held by another pod, closed) is what `blocker` says.
    view = TaskView.of(kube.get(TASKS, "guarded"))
    assert blocker(view, None, now_utc()) is None
    task = alice.claim("g", timeout=30)  # a fair claim passes
    held = copy.deepcopy(kube.get(LEASES, "guarded"))
    assert blocker(view, record.decode(held), now_utc()) is Blocker.HELD

    takeover = copy.deepcopy(held)
    takeover["spec"].update(holderIdentity="bob/1", leaseTransitions=2)
    _refused(lambda: _patch(bob_kube, takeover), "this lease is held by another pod", standing=True)
    impersonation = copy.deepcopy(held)
    impersonation["spec"]["holderIdentity"] = "alice/evil"
    _refused(lambda: _patch(bob_kube, impersonation), "only hold a lease in its own pod's name")
    lowered = copy.deepcopy(held)
    lowered["spec"]["leaseTransitions"] = 0
    _refused(lambda: _patch(alice_kube, lowered), "never goes down", standing=True)
    handover = copy.deepcopy(held)
    handover["spec"]["holderIdentity"] = "alice/2"
    _refused(lambda: _patch(alice_kube, handover), "cannot hand its lease", standing=True)
    more_attempts = copy.deepcopy(held)
    more_attempts["metadata"].setdefault("annotations", {})[record.ANN_BUDGET_FROM] = "7"
    _refused(lambda: _patch(alice_kube, more_attempts), "cannot change tasklease.dev/budget-from", standing=True)
    _refused(lambda: alice_kube.delete(LEASES, "guarded"), "a task's Lease is never deleted")

    task.complete("done")  # the holder's fair completion passes
    closed = kube.get(LEASES, "guarded")
    assert blocker(view, record.decode(closed), now_utc()) is Blocker.CLOSED
    reopened = copy.deepcopy(closed)
    reopened["spec"].update(holderIdentity="bob/1", leaseTransitions=2)
    _refused(lambda: _patch(bob_kube, reopened), "a finished task never runs again", standing=True)

    unbound = Kube.connect(kubeconfig=str(service_account_kubeconfig(cluster, namespace, AGENT_SA,
                                                                     chart_roles["agent"], tmp_path)))
    make_task(kube, "second", queue="g2")
    _refused(lambda: Agent(unbound, identity=Identity(pod="bob", instance="1")).claim_once("g2"),
             "must authenticate with a token bound to their Pod")

    # A holder may name its pod's uid (POD_UID), and only its own.
    bob_uid = kube.get(PODS, "bob")["metadata"]["uid"]
    alice_uid = kube.get(PODS, "alice")["metadata"]["uid"]
    _refused(lambda: Agent(bob_kube, identity=Identity(pod="bob", instance="1", pod_uid=alice_uid)).claim_once("g2"),
             "only name its own pod's uid")
    # A restarted agent of the same pod may still release its previous instance's lease.
    Agent(bob_kube, identity=Identity(pod="bob", instance="999999.1.gone", pod_uid=bob_uid)).claim_once("g2").detach()
    assert Agent(bob_kube, identity=Identity(pod="bob", instance="2", pod_uid=bob_uid)).start() == ["second"]
    # An agent in another container of the pod (TASKLEASE_AGENT_ID) still holds in the pod's name.
    make_task(kube, "third", queue="g3")
    Agent(bob_kube, identity=Identity(pod="bob", instance="sidecar:1", pod_uid=bob_uid)).claim_once("g3").complete("ok")
    assert record.decode(kube.get(LEASES, "third")).result == "ok"
    alice.close()


def _delete_probe(admin: Kube, agent: Kube) -> None:
    """An agent deleting a Lease that is not its member Lease."""
    if admin.get_or_none(LEASES, "delete-probe") is None:
        admin.create(LEASES, {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                              "metadata": {"name": "delete-probe"}, "spec": {}})
    agent.delete(LEASES, "delete-probe")


def test_the_chart_policy_is_generated_from_the_models() -> None:
    """The checked-in policy is what `make generate` writes: its limits are the Task schema's."""
    assert policy.target(ROOT).read_text() == policy.render(), "stale: run `make generate`"


def test_helm_template_shows_the_policy_by_default() -> None:
    docs = render()
    found = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"]
    names = ["rel-agent-protocol", "rel-agent-leave", "rel-operator-renew"]
    assert [d["metadata"]["name"] for d in found] == names
    assert all(d["spec"]["failurePolicy"] == "Fail" for d in found)
    bindings = [d["spec"] for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"]
    assert bindings == [{"policyName": n, "validationActions": ["Deny"]} for n in names]
    # The operator's renewals of pod-bound leases: judged by the operator's own ServiceAccount.
    renew = found[2]["spec"]["matchConditions"][0]["expression"]
    assert "== 'system:serviceaccount:ops:rel-operator'" in renew
    # Matched by who writes, never by a label of the Lease, which its writer controls.
    assert "objectSelector" not in found[0]["spec"]["matchConstraints"]
    election = [v["expression"] for v in found[0]["spec"]["validations"] if "election" in v["message"]]
    assert election and "request.namespace == 'ops'" in election[0]
    assert not [d for d in render("agents.enforceProtocol=false") if d["kind"].startswith("ValidatingAdmission")]


def _agent_lease_verbs(*values: str) -> set[str]:
    role = next(d for d in render(*values) if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "rel-agent")
    return {v for r in role["rules"] if "leases" in r["resources"] for v in r["verbs"]}


def test_agents_may_delete_leases_only_beside_the_policy_that_limits_it() -> None:
    """Deleting a task's Lease would reset its fencing epoch: the agents' role grants delete
    (to leave a queue) only where the policy refuses every delete but an agent's own member Lease."""
    assert "delete" in _agent_lease_verbs()
    assert "delete" not in _agent_lease_verbs("agents.enforceProtocol=false")

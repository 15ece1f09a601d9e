"""20 agents race for 200 tasks: one holder per attempt, proved from the API server's audit log.

Agents divide a queue among themselves and seldom race (on a loaded machine, sometimes never
in a whole run), so the test also makes a race that does not depend on timing: five claims of
one task made from the same picture (no Lease yet), as agents whose pictures lag make them."""

from __future__ import annotations

import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

from conftest import Cluster, make_task, read_audit
from tasklease.agent import Agent, ClaimedTask, Identity
from tasklease.api import errors
from tasklease.kube import LEASES, TASKS
from tasklease.protocol import Protocol, TaskView, members, record


def test_twenty_agents_two_hundred_tasks_one_owner_each(cluster: Cluster, namespace: str, audit_log: Path) -> None:
    admin = cluster.kube(namespace)
    for i in range(200):
        make_task(admin, f"task-{i:03d}", queue="race", payload={"n": i})

    done: dict[str, list[tuple[str, int]]] = defaultdict(list)
    lock = threading.Lock()
    stop = threading.Event()
    winner = _five_claims_of_one_task(Protocol(admin), TaskView.of(admin.get(TASKS, "task-000")))
    done["task-000"].append((winner, 1))

    def handler(task: ClaimedTask) -> str:
        with lock:
            done[task.name].append((task.holder, task.epoch))
            if sum(len(v) for v in done.values()) >= 200:
                stop.set()
        return f"{task.payload['n']} by {task.holder}"

    agents = [Agent(cluster.kube(namespace), identity=Identity(pod=f"agent-{i}", instance="a")) for i in range(20)]
    threads = [threading.Thread(target=a.work, args=("race", handler), kwargs={"stop": stop}) for a in agents]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    for a in agents:
        a.close()
    assert not any(t.is_alive() for t in threads), "agents did not finish in time"

    # Every task was worked on exactly once, by the agent that claimed attempt 1.
    assert sorted(done) == [f"task-{i:03d}" for i in range(200)]
    assert all(len(v) == 1 and v[0][1] == 1 for v in done.values())
    assert len({holder for v in done.values() for holder, _ in v}) > 1, "one agent did everything: no race"

    # Every Lease ends closed/Succeeded with the result of the agent that held it.
    for name, [(holder, _)] in done.items():
        rec = record.decode(admin.get(LEASES, name))
        assert (rec.outcome, rec.epoch) == ("Succeeded", 1)
        assert rec.result.endswith(f"by {holder}")

    # The audit log has every Lease write the API server accepted: replay them per Lease.
    writes = _accepted_lease_writes(audit_log, namespace)
    assert sum(len(w) for w in writes.values()) == 400  # one claim and one completion per task
    for name, states in writes.items():
        holders_per_epoch: dict[int, set[str]] = defaultdict(set)
        previous: dict[str, Any] = {}
        for state in states:
            holder, epoch = state.get("holderIdentity") or "", int(state.get("leaseTransitions") or 0)
            if holder:
                holders_per_epoch[epoch].add(holder)
                if holder != (previous.get("holderIdentity") or ""):
                    # A new holder only ever follows a free Lease, one epoch up: never two holders.
                    assert not previous.get("holderIdentity"), f"{name}: {holder} took over a held lease"
                    assert epoch == int(previous.get("leaseTransitions") or 0) + 1
            previous = state
        assert all(len(h) == 1 for h in holders_per_epoch.values()), f"{name}: two holders in one epoch"
    rejected = [e for e in read_audit(audit_log, namespace=namespace, resource="leases")
                if e["verb"] in ("create", "patch", "update") and e["responseStatus"]["code"] == 409]
    creates = sum(1 for e in rejected if e["verb"] == "create")
    raced = [e["responseStatus"]["code"] for e in read_audit(audit_log, namespace=namespace, resource="leases")
             if e["verb"] == "create" and e["objectRef"].get("name") == "task-000"]
    assert sorted(raced)[:5] == [201, 409, 409, 409, 409]  # the five from one picture: one won
    print(f"\n{len(rejected)} claims lost a race (409: {creates} creates, {len(rejected) - creates} updates)")


def _five_claims_of_one_task(protocol: Protocol, task: TaskView) -> str:
    """Five holders claim `task` at once, each seeing no Lease; the winner completes it. Its holder."""
    start, won, lost = threading.Barrier(5), [], []

    def claim(holder: str) -> None:
        start.wait()
        try:
            held = protocol.claim(task, None, holder)
        except errors.Conflict:
            lost.append(holder)
            return
        won.append(holder)
        protocol.complete(held, f"{task.spec.payload['n']} by {holder}")

    racers = [threading.Thread(target=claim, args=(f"racer-{i}/a",)) for i in range(5)]
    for t in racers:
        t.start()
    for t in racers:
        t.join(60)
    assert len(won) == 1 and len(lost) == 4
    return won[0]


def _accepted_lease_writes(path: Path, namespace: str) -> dict[str, list[dict[str, Any]]]:
    by_lease: dict[str, list[tuple[int, dict[str, Any]]]] = defaultdict(list)
    for e in read_audit(path, namespace=namespace, resource="leases"):
        if e["verb"] in ("create", "patch", "update") and e["responseStatus"]["code"] in (200, 201):
            obj = e["responseObject"]
            if members.LABEL_AGENT_OF in (obj["metadata"].get("labels") or {}):
                continue  # an agent telling its peers it works the queue: not a task's Lease
            by_lease[obj["metadata"]["name"]].append((int(obj["metadata"]["resourceVersion"]), obj["spec"]))
    return {name: [spec for _, spec in sorted(w)] for name, w in by_lease.items()}

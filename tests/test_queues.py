"""TaskQueues against the real control plane: pause, resume, maxRunning under a race (proved
from the API server's audit log), status, columns, Events, the CLI, and agents that ignore
the controls."""

from __future__ import annotations

import subprocess
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from conftest import (Cluster, Operator, agent_pod_kubeconfig, make_queue, make_task, read_audit, refusal,
                      tasklease_cmd, undone, wait_for)
from tasklease.agent import Agent, ClaimedTask, Identity
from tasklease.api import errors, queues
from tasklease.operator.queues import PAUSE_GRACE_S, rate_allowance
from tasklease.kube import EVENTS, LEASES, TASKQUEUES, TASKS, Kube
from tasklease.protocol import Protocol, TaskView, rate, record, slots


def _cli(cluster: Cluster, namespace: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(tasklease_cmd(*args, f"--kubeconfig={cluster.kubeconfig}", "-n", namespace),
                          capture_output=True, text=True, timeout=60)


def _events(kube: Kube, name: str) -> list[str]:
    return [e["reason"] for e in kube.list(EVENTS, field_selector=f"involvedObject.name={name},"
                                                                  f"involvedObject.kind=TaskQueue")["items"]]


def test_pause_stops_claims_and_resume_restarts_them(cluster: Cluster, kube: Kube, namespace: str) -> None:
    for i in range(3):
        make_task(kube, f"p-{i}", queue="mail")
    paused = _cli(cluster, namespace, "pause", "mail")
    assert paused.returncode == 0 and "paused (TaskQueue created)" in paused.stdout, paused.stderr
    assert kube.get(TASKQUEUES, "mail")["spec"]["paused"] is True

    with Agent(cluster.kube(namespace), identity=Identity(pod="worker", instance="1")) as agent:
        with pytest.raises(errors.NothingToClaim):
            agent.claim("mail", timeout=2)
        once = _cli(cluster, namespace, "claim", "--queue", "mail")
        assert once.returncode == 3 and once.stderr.strip() == "tasklease: queue 'mail' is paused", once.stderr
        assert not kube.list(LEASES, label_selector=record.MANAGED_SELECTOR)["items"], "a paused queue was claimed"

        resumed = _cli(cluster, namespace, "resume", "mail")
        assert resumed.returncode == 0 and "resumed" in resumed.stdout
        with agent.claim("mail", timeout=30) as task:
            task.complete("ok")

    missing = _cli(cluster, namespace, "resume", "nothing-here")
    assert missing.returncode == 0 and "has no TaskQueue" in missing.stdout
    bad = _cli(cluster, namespace, "pause", "Not_A_Queue")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and bad.stderr.startswith("tasklease pause: "), \
        bad.stderr


def test_max_running_holds_under_a_race_of_16_agents(cluster: Cluster, namespace: str, audit_log: Path) -> None:
    limit, total = 3, 48
    admin = cluster.kube(namespace)
    make_queue(admin, "limited", maxRunning=limit)
    for i in range(total):
        make_task(admin, f"job-{i:02d}", queue="limited")
    lock, stop = threading.Lock(), threading.Event()
    running, peak, done = 0, 0, 0

    def handler(task: ClaimedTask) -> str:
        nonlocal running, peak, done
        with lock:
            running += 1
            peak = max(peak, running)
        stop.wait(0.05)  # long enough for claims to pile up behind the limit
        with lock:
            running -= 1
            done += 1
            if done >= total:
                stop.set()
        return "ok"

    agents = [Agent(cluster.kube(namespace), identity=Identity(pod=f"agent-{i}", instance="a")) for i in range(16)]
    threads = [threading.Thread(target=a.work, args=("limited", handler), kwargs={"stop": stop}) for a in agents]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    for a in agents:
        a.close()
    assert not any(t.is_alive() for t in threads), "agents did not finish in time"
    assert done == total and peak <= limit

    # Every write the API server accepted, in its order (resourceVersions are etcd's revisions):
    # no instant with more than `limit` task Leases held, and the limit was reached.
    writes = []
    for e in read_audit(audit_log, namespace=namespace, resource="leases"):
        if e["verb"] in ("create", "patch", "update") and e["responseStatus"]["code"] in (200, 201):
            obj = e["responseObject"]
            if (obj["metadata"].get("labels") or {}).get(record.LABEL_MANAGED) == "tasklease":
                writes.append((int(obj["metadata"]["resourceVersion"]), obj["metadata"]["name"],
                               obj["spec"].get("holderIdentity") or ""))
    held: set[str] = set()
    most = 0
    for _, name, holder in sorted(writes):
        (held.add if holder else held.discard)(name)
        most = max(most, len(held))
    assert len({name for _, name, _ in writes}) == total
    assert most == limit, f"at most {most} held at once (limit {limit})"
    print(f"\n{len(writes)} task Lease writes replayed; at most {most} held at once; peak in handlers {peak}")


def test_the_operator_takes_back_claims_that_ignore_the_controls(
        cluster: Cluster, kube: Kube, namespace: str, operator: Operator) -> None:
    """A hostile agent claims with the protocol alone, skipping the gate: the operator undoes it."""
    make_queue(kube, "guarded", maxRunning=1)
    make_queue(kube, "stopped", paused=True)
    for name, queue in (("g-1", "guarded"), ("g-2", "guarded"), ("s-1", "stopped")):
        make_task(kube, name, queue=queue)
    rogue = Protocol(kube)
    wait_for(lambda: kube.get(TASKQUEUES, "stopped").get("status", {}).get("observedGeneration"),
             message="the operator to see the paused queue")
    time.sleep(PAUSE_GRACE_S)  # a claim within the grace after the pause may have been in flight: tolerated
    held = [rogue.claim(TaskView.of(kube.get(TASKS, n)), None, "rogue/1") for n in ("g-1", "g-2", "s-1")]
    assert all(h.epoch == 1 for h in held)

    wait_for(lambda: undone(kube, "s-1"), timeout=30, message="the claim made while paused undone")
    wait_for(lambda: undone(kube, "g-1") and undone(kube, "g-2"), timeout=60,
             message="the claims without a slot undone")
    assert "while queue stopped is paused" in record.decode(kube.get(LEASES, "s-1")).history[-1].message
    with pytest.raises(errors.LostLease):
        rogue.complete(held[0], "mine anyway")
    # The Event follows the Lease write that the waits above saw.
    wait_for(lambda: queues.CLAIM_UNDONE in _events(kube, "guarded"), message="the ClaimUndone Event")

    # Claims beyond the rate (the operator has run longer than its window by now): the excess is undone.
    make_queue(kube, "slow", claimsPerSecond=0.1)
    allowed = rate_allowance(0.1)
    for i in range(allowed + 2):
        make_task(kube, f"fast-{i}", queue="slow")
    for i in range(allowed + 2):
        rogue.claim(TaskView.of(kube.get(TASKS, f"fast-{i}")), None, "rogue/1")
    wait_for(lambda: sum(undone(kube, f"fast-{i}") for i in range(allowed + 2)) == 2, timeout=30,
             message="the claims beyond the rate undone")
    kept = [i for i in range(allowed + 2) if not undone(kube, f"fast-{i}")]
    assert len(kept) == allowed and all(record.decode(kube.get(LEASES, f"fast-{i}")).holder for i in kept)

    # A slot held by nobody's task (its agent died) is freed for the others.
    dead = slots.acquire(kube, [], namespace=namespace, queue="guarded", holder="dead/1", limit=1)
    assert dead is not None
    wait_for(lambda: not (kube.get(LEASES, dead.name)["spec"].get("holderIdentity")), timeout=60,
             message="the dead agent's slot freed")


def test_agents_may_hold_slots_only_in_their_own_name(
        cluster: Cluster, kube: Kube, namespace: str, chart_roles: dict[str, str], tmp_path: Path) -> None:
    make_queue(kube, "shared", maxRunning=1)
    alice = Kube.connect(kubeconfig=str(agent_pod_kubeconfig(cluster, namespace, "alice", chart_roles["agent"],
                                                             tmp_path)))
    bob = Kube.connect(kubeconfig=str(agent_pod_kubeconfig(cluster, namespace, "bob", chart_roles["agent"], tmp_path)))
    forged = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
              "metadata": {"name": slots.slot_name("shared", 0), "labels": {slots.LABEL_SLOT_OF: "shared"}},
              "spec": {"holderIdentity": "alice/1", "leaseDurationSeconds": slots.DURATION_S}}
    wait_for(lambda: "may only hold a lease in its own pod's name" in refusal(lambda: bob.create(LEASES, forged)),
             timeout=30, message="the admission policy to be active")
    mine = slots.acquire(alice, [], namespace=namespace, queue="shared", holder="alice/1", limit=1)
    assert mine is not None
    # Bob cannot free Alice's slot, nor take it, nor make one outside the semaphore's names.
    assert "held by another pod" in refusal(
        lambda: bob.merge_patch(LEASES, mine.name, {"spec": {"holderIdentity": None}}))
    assert "held by another pod" in refusal(
        lambda: bob.merge_patch(LEASES, mine.name, {"spec": {"holderIdentity": "bob/1"}}))
    odd = {**forged, "metadata": {"name": "tasklease-slot.other.0", "labels": {slots.LABEL_SLOT_OF: "shared"}},
           "spec": {"holderIdentity": "bob/1", "leaseDurationSeconds": slots.DURATION_S}}
    assert "named tasklease-slot.<queue>.<number>" in refusal(lambda: bob.create(LEASES, odd))
    # Nor move a free slot to another queue's semaphore.
    assert slots.release(alice, mine)
    assert refusal(lambda: bob.merge_patch(LEASES, mine.name, {"metadata": {"labels": {slots.LABEL_SLOT_OF: "other"}}}))
    assert kube.get(LEASES, mine.name)["metadata"]["labels"][slots.LABEL_SLOT_OF] == "shared"


def test_no_agent_can_hold_the_claim_rate_bucket(
        cluster: Cluster, kube: Kube, namespace: str, chart_roles: dict[str, str], tmp_path: Path) -> None:
    """Every agent of a paced queue writes its bucket: one that held it would stop every other
    agent's claims (their writes refused as the Lease of another pod)."""
    make_queue(kube, "paced", claimsPerSecond=100)
    alice, bob = (Kube.connect(kubeconfig=str(agent_pod_kubeconfig(cluster, namespace, pod, chart_roles["agent"],
                                                                   tmp_path))) for pod in ("alice", "bob"))
    bucket = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
              "metadata": {"name": rate.lease_name("paced"), "labels": {slots.LABEL_SLOT_OF: "paced"}},
              "spec": {"holderIdentity": "bob/1", "leaseDurationSeconds": slots.DURATION_S}}
    held_by_no_one = "the claim-rate Lease (tasklease-slot.<queue>.rate) is held by no one"
    wait_for(lambda: held_by_no_one in refusal(lambda: bob.create(LEASES, bucket)),
             timeout=30, message="the admission policy to be active")
    # The bucket, made by alice's first token (asked for again while her clock of the server is unsure).
    wait_for(lambda: rate.take(alice, namespace=namespace, queue="paced", rate=100) == 0.0, timeout=10,
             message="alice to take a token")
    assert held_by_no_one in refusal(
        lambda: bob.merge_patch(LEASES, rate.lease_name("paced"), {"spec": {"holderIdentity": "bob/1"}}))
    assert not kube.get(LEASES, rate.lease_name("paced"))["spec"].get("holderIdentity")
    wait_for(lambda: rate.take(alice, namespace=namespace, queue="paced", rate=100) == 0.0, timeout=10,
             message="alice to take a token from the bucket bob tried to hold")
    assert kube.get(LEASES, rate.lease_name("paced"))["metadata"]["annotations"][rate.ANN_NEXT]


def test_status_columns_and_events(cluster: Cluster, kube: Kube, namespace: str, operator: Operator) -> None:
    make_queue(kube, "shop", maxRunning=1)
    for i in range(3):
        make_task(kube, f"o-{i}", queue="shop")
    with Agent(cluster.kube(namespace), identity=Identity(pod="worker", instance="1")) as agent:
        task = agent.claim("shop", timeout=30)

        def status() -> dict[str, Any]:
            return dict(kube.get(TASKQUEUES, "shop").get("status") or {})
        wait_for(lambda: (status().get("running"), status().get("claimable"), status().get("slotsHeld")) == (1, 2, 1),
                 timeout=30, message=f"the status to count the queue: {status()}")
        assert status()["pending"] == 2 and status()["oldestClaimableSince"]
        wait_for(lambda: queues.LIMIT_REACHED in _events(kube, "shop"), message="LimitReached")

        header = cluster.kubectl("get", "taskqueues", "-n", namespace).stdout.splitlines()[0].split()
        assert header == ["NAME", "PAUSED", "MAX-RUNNING", "RATE", "RUNNING", "CLAIMABLE", "PENDING",
                          "OLDEST-CLAIMABLE", "AGE"]
        row = cluster.kubectl("get", "tq", "shop", "-n", namespace, "--no-headers").stdout.split()
        assert row[:6] == ["shop", "false", "1", "1", "2", "2"], row  # no rate: an empty cell

        top = _cli(cluster, namespace, "top", "--once")
        line = next(ln.split() for ln in top.stdout.splitlines() if " shop " in f" {ln} ")
        assert line[2] == "max=1", top.stdout
        task.complete("done")

    assert _cli(cluster, namespace, "pause", "shop").returncode == 0
    wait_for(lambda: queues.PAUSED in _events(kube, "shop"), message="Paused")
    assert _cli(cluster, namespace, "resume", "shop").returncode == 0
    wait_for(lambda: queues.RESUMED in _events(kube, "shop"), message="Resumed")


def test_claims_per_second_bounds_the_claims_of_every_agent(cluster: Cluster, namespace: str,
                                                            audit_log: Path) -> None:
    per_s, total = 4.0, 16
    admin = cluster.kube(namespace)
    make_queue(admin, "paced", claimsPerSecond=per_s)
    for i in range(total):
        make_task(admin, f"r-{i:02d}", queue="paced")
    stop, lock, done = threading.Event(), threading.Lock(), [0]

    def handler(task: ClaimedTask) -> str:
        with lock:
            done[0] += 1
            if done[0] >= total:
                stop.set()
        return "ok"

    agents = [Agent(cluster.kube(namespace), identity=Identity(pod=f"pacer-{i}", instance="a")) for i in range(4)]
    threads = [threading.Thread(target=a.work, args=("paced", handler), kwargs={"stop": stop}) for a in agents]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for a in agents:
        a.close()
    assert done[0] == total
    # The tokens taken (writes of the queue's bucket), by the API server's clock: at most one
    # second's burst and a second's claims within any second; one claim per token.
    events = [e for e in read_audit(audit_log, namespace=namespace, resource="leases")
              if e["verb"] in ("create", "patch", "update") and e["responseStatus"]["code"] in (200, 201)]

    def stamps(chosen: list[dict[str, Any]]) -> list[float]:
        return sorted(datetime.fromisoformat(e["stageTimestamp"]).timestamp() for e in chosen)
    tokens = stamps([e for e in events if e["objectRef"]["name"] == rate.lease_name("paced")])
    claims = stamps([e for e in events if e["responseObject"]["spec"].get("leaseTransitions") == 1
                     and (e["responseObject"]["metadata"].get("labels") or {}).get(record.LABEL_STATE) == record.HELD])
    assert len(claims) == total and len(tokens) >= total
    for i, start in enumerate(tokens):
        in_a_second = sum(1 for t in tokens[i:] if t - start < 1.0)
        assert in_a_second <= per_s * (rate.BURST_S + 1) + 1, f"{in_a_second} tokens within a second"
    span = claims[-1] - claims[0]
    assert span >= (total - per_s * rate.BURST_S - 1) / per_s, f"{total} claims in {span:.2f}s"


def test_a_shell_claim_keeps_its_slot_until_its_task_ends(cluster: Cluster, kube: Kube, namespace: str) -> None:
    """`tasklease claim --wait` claims through the SDK and hands the lease to the shell: its slot stays taken."""
    make_queue(kube, "one", maxRunning=1)
    for i in range(2):
        make_task(kube, f"sh-{i}", queue="one")
    first = _cli(cluster, namespace, "claim", "--queue", "one", "--wait", "30")
    assert first.returncode == 0, first.stderr
    second = _cli(cluster, namespace, "claim", "--queue", "one")
    assert second.returncode == 3 and "runs its maxRunning (1) tasks" in second.stderr, second.stderr
    held = [o for o in kube.list(LEASES, label_selector=record.MANAGED_SELECTOR)["items"]
            if o["spec"].get("holderIdentity")]
    assert len(held) == 1

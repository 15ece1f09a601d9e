"""Discovery: strict priority, agents spread within a band, and renewals that wake nobody."""

from __future__ import annotations

import contextlib
import functools
import random
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from conftest import make_task, wait_for
from tasklease.agent import Agent, Identity
from tasklease.agent import discovery
from tasklease.agent.membership import Membership
from tasklease.agent import division
from tasklease.agent.candidates import CandidateIndex
from tasklease.agent.compact import compact, expand
from tasklease.agent.discovery import QueueView
from tasklease.agent.division import Owner, divide, owned_weight, owner, weight
from tasklease.api import errors, models
from tasklease.api.timestamps import now_utc
from tasklease.kube import LEASES, TASKS, Kube
from tasklease.kube.watching import Reflector
from tasklease.protocol import LeaseRecord, Protocol, TaskView, members, record
from tasklease.protocol.members import MemberLease


@pytest.mark.unit
def test_the_index_offers_only_the_highest_band_oldest_first() -> None:
    index = CandidateIndex()
    for i in range(100):
        index.add(f"low-{i:03d}", 0, f"2026-01-01T00:{i // 60:02d}:{i % 60:02d}Z")
    index.add("mid", 5, "2026-01-01T00:00:00Z")
    index.add("top", 1000, "2026-01-01T00:09:00Z")
    assert index.best(8) == ["top"]  # never a lower band while a higher one has a candidate
    index.discard("top")
    assert index.best(8) == ["mid"]
    index.discard("mid")
    assert index.best(3) == ["low-000", "low-001", "low-002"]  # oldest first
    index.add("low-050", 7, "2026-01-01T00:00:50Z")  # its priority was raised
    assert index.best(3) == ["low-050"]
    for i in range(100):
        index.discard(f"low-{i:03d}")
    assert index.best(3) == [] and len(index) == 0


@pytest.mark.unit
def test_the_index_answers_as_a_sorted_list_of_its_live_candidates_would() -> None:
    """Whatever the order of additions, removals, re-additions and looks of any width: the
    heaps, their lazily deleted entries and the kept prefix of each band never show."""
    for seed in range(100):
        rng = random.Random(seed)
        index, live = CandidateIndex(), {}
        for _ in range(400):
            name, op = f"t{rng.randrange(60)}", rng.random()
            if op < 0.5:
                live[name] = (rng.choice([0, 0, 0, 5, 9]), f"2026-01-01T00:00:{rng.randrange(30):02d}Z")
                index.add(name, *live[name])
            elif op < 0.8:
                index.discard(name)
                live.pop(name, None)
            else:
                window = rng.choice([1, 3, 8, 32])
                top = max((p for p, _ in live.values()), default=0)
                expected = [n for _, n in sorted((c, n) for n, (p, c) in live.items() if p == top)][:window]
                assert index.best(window) == expected, f"seed {seed}"


@pytest.mark.unit
def test_agents_that_know_each_other_divide_a_band_without_overlap() -> None:
    names = [f"task-{i:03d}" for i in range(128)]
    agents = [f"agent-{a}/x" for a in range(16)]
    owners = functools.partial(owner, agents)
    divisions = {a: divide(a, names, owners) for a in agents}
    ours = [set(d.names) for d in divisions.values()]
    assert sum(len(o) for o in ours) == len(names) and set().union(*ours) == set(names)  # each task once
    assert all(ours)  # each agent has work of its own: nobody needs to steal
    assert all(d.ours == len(d.names) and d.owner is None for d in divisions.values())
    # The same division whatever order the names come in, and ours in our own weight order.
    again = divide(agents[0], list(reversed(names)), owners)
    assert again == divisions[agents[0]]
    mine = again.names[:again.ours]
    assert mine == sorted(mine, key=lambda n: weight(agents[0], n), reverse=True)


@pytest.mark.unit
def test_an_agent_knows_its_own_tasks_as_the_owner_would_say_without_hashing_every_peer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    agents = [f"agent-{a}/x" for a in range(16)]
    names = [f"task-{i:03d}" for i in range(400)]
    for me in agents[:4]:
        for name in names:
            top, first, _ = owner(agents, name)
            assert owned_weight(me, agents, name) == (top if first == me else None)
    calls = 0

    def counted(holder: str, name: str) -> float:
        nonlocal calls
        calls += 1
        return weight(holder, name)
    monkeypatch.setattr(division, "weight", counted)
    for name in names:
        owned_weight(agents[0], agents, name)
    assert calls < len(names) * len(agents) / 2  # most tasks are another's, and found so early


@pytest.mark.unit
def test_a_thief_takes_from_busy_owners_first_deputies_first() -> None:
    names = [f"task-{i:02d}" for i in range(3)]
    table = {"task-00": (0.8, "idle", "other"), "task-01": (0.5, "busy", "other"), "task-02": (0.4, "busy", "me")}
    division = divide("me", names, lambda n: table[n], busy={"busy"})
    # Long work keeps the busy owner away; the idle one takes its own at once if it is alive;
    # among the busy owner's, the one we are the deputy for first.
    assert division.ours == 0 and division.names == ["task-02", "task-01", "task-00"]
    assert division.owner is Owner.BUSY and division.deputy
    idle = divide("me", names[:1], lambda n: table[n])
    assert idle.owner is Owner.IDLE and not idle.deputy
    # Everyone agrees on each task's owner and deputy, and the deputy is the next in line.
    agents = [f"agent-{a}/x" for a in range(8)]
    for name in names:
        top, first, deputy = owner(agents, name)
        assert owner(list(reversed(agents)), name) == (top, first, deputy)
        assert owner([a for a in agents if a != first], name)[1] == deputy


@pytest.mark.unit
def test_strict_priority_holds_whoever_owns_what() -> None:
    index = CandidateIndex()
    for i in range(64):
        index.add(f"low-{i:02d}", 0, f"2026-01-01T00:00:{i:02d}Z")
    index.add("urgent", 1000, "2026-01-01T00:10:00Z")
    agents = [f"agent-{a}/x" for a in range(16)]
    # Whoever owns it, every agent is offered only the urgent task: a thief takes it, or its owner.
    assert {tuple(divide(a, index.best(128), functools.partial(owner, agents)).names) for a in agents} == {("urgent",)}


def test_an_agent_whose_peers_own_the_oldest_tasks_looks_deeper_instead_of_idling(
        kube: Kube, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by draining 100,000 tasks with 16 agents: agents that owned none of the oldest
    tasks, all of whose owners were claiming, waited until their idle timeout and stopped.
    The claiming owners' tasks leave the index ("parked"): no later look passes them again."""
    peers = [f"peer-{p:02d}/x" for p in range(15)]
    everyone = [*peers, "me/x"]
    view = QueueView(kube, namespace="ns", queue="deep")  # fed by hand below: never started

    def task(name: str, second: int) -> dict[str, Any]:
        return {"metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}",
                             "creationTimestamp": f"2026-01-01T{second // 3600:02d}:{second // 60 % 60:02d}:"
                                                  f"{second % 60:02d}Z"}, "spec": {"queue": "deep"}}
    for p, peer in enumerate(peers):  # each peer is claiming: at work, taking its own
        view._on_task("ADDED", task(f"held-{p}", p))
        view._on_member("ADDED", {"metadata": {"name": members.lease_name("deep", peer), "annotations": {
            members.ANN_TOOK: f'["held-{p}"]', members.ANN_HOLDING: "1", members.ANN_CLAIMING: "true"}},
            "spec": {"holderIdentity": peer}})
    theirs = (n for n in (f"t-{i:05d}" for i in range(100000)) if owner(everyone, n)[1] != "me/x")
    for second in range(100, 800):  # the 700 oldest open tasks are all the peers'
        view._on_task("ADDED", task(next(theirs), second))
    mine = [n for n in (f"m-{i:05d}" for i in range(1000)) if owner(everyone, n)[1] == "me/x"][:5]
    for second, name in enumerate(mine, start=800):
        view._on_task("ADDED", task(name, second))
    candidates, division = view.choose("me/x", now_utc(), window=32)
    assert division.ours == len(mine) and {t.name for t, _ in candidates} == set(mine)
    assert view.claimable_count() == len(mine)  # the peers' 700 are parked
    # The next look finds ours at once; no owner is computed (every peer claims: none need be known).
    counted: list[str] = []
    monkeypatch.setattr(discovery, "owner", lambda peers, name: counted.append(name) or owner(peers, name))
    view.mark_taken(candidates[0][0].name, None)
    again, division = view.choose("me/x", now_utc(), window=32)
    assert division.ours == len(mine) - 1 and counted == []


def test_a_claim_takes_the_highest_priority_task_every_time(kube: Kube) -> None:
    for i in range(40):
        make_task(kube, f"low-{i:02d}", queue="prio")
    agent = Agent(kube, identity=Identity(pod="prio-agent", instance="a"))
    view = agent.watch("prio")
    try:
        for round_ in range(5):
            make_task(kube, f"urgent-{round_}", queue="prio", priority=1000)
            # The urgent task must be in the agent's picture before the claim can be judged.
            wait_for(lambda round_=round_: any(t.name == f"urgent-{round_}"
                                               for t, _ in view.choose("x", now_utc(), window=1)[0]),
                     message="the urgent task in the agent's view")
            task = agent.claim("prio", timeout=30)
            assert task.name == f"urgent-{round_}"
            task.complete("done")
        task = agent.claim("prio", timeout=30)
        assert task.name.startswith("low-")
        task.release()
    finally:
        agent.close()


def test_a_held_leases_renewals_wake_no_idle_agent(kube: Kube) -> None:
    make_task(kube, "busy", queue="renewals")
    holder = Agent(kube, identity=Identity(pod="holder", instance="a"))
    idle = Agent(kube, identity=Identity(pod="idle", instance="b"))
    try:
        task = holder.claim("renewals", timeout=30)
        task.detach()  # renew by hand below, so the count of renewals is exact
        view = idle.watch("renewals")
        wait_for(lambda: view.claimable_count() == 0, message="the idle agent to see the task held")
        before = view.wakeups
        protocol = Protocol(kube)
        held = task.held
        for _ in range(10):
            held = protocol.renew(held)
        protocol.release(held, "done renewing")
        # The release comes after the renewals on the same watch stream: once it has woken
        # the idle agent, every renewal has been through its picture too.
        wait_for(lambda: view.claimable_count() == 1, message="the release to reach the idle agent")
        assert view.wakeups == before + 1
    finally:
        holder.close()
        idle.close()


def test_an_agent_learns_what_is_taken_without_seeing_held_leases(kube: Kube) -> None:
    """Agents watch only free Leases and member Leases: a Lease leaving the free selector,
    a peer's `took` and a status showing an attempt each make a task not claimable."""
    view = QueueView(kube, namespace="ns", queue="q")  # fed by hand below: never started

    def task(name: str, attempt: int = 0) -> dict[str, Any]:
        return {"metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}",
                             "creationTimestamp": "2026-01-01T00:00:00Z"}, "spec": {"queue": "q"},
                "status": {"attempt": attempt}}

    def free(version: str) -> dict[str, Any]:
        return record.encode(LeaseRecord(name="retried", namespace="ns", queue="q", owner_uid="uid-retried",
                                         epoch=1, resource_version=version))
    view._on_task("ADDED", task("retried", attempt=1))
    assert view.claimable_count() == 0  # claimed before, and no free Lease of it known: held or closed
    view._on_lease("ADDED", free("5"))
    assert view.claimable_count() == 1
    view._on_lease("DELETED", free("6"))  # claimed or closed elsewhere: it left the free selector
    assert view.claimable_count() == 0
    view._on_lease("ADDED", free("9"))  # free again
    assert view.claimable_count() == 1

    view._on_task("ADDED", task("fresh"))
    assert view.claimable_count() == 2
    # Claimed by creating its Lease, which no watch of ours shows: its claimer's member Lease tells.
    view._on_member("ADDED", {"metadata": {"name": members.lease_name("q", "peer/x"),
                                           "annotations": {members.ANN_TOOK: '["fresh"]'}},
                              "spec": {"holderIdentity": "peer/x"}})
    assert view.claimable_count() == 1
    candidates, division = view.choose("peer/x", now_utc(), window=8)
    assert [t.name for t, _ in candidates] == ["retried"]


def test_a_thief_leaves_a_new_task_to_its_owner_until_it_could_have_been_told_taken(kube: Kube) -> None:
    """A task its owner claimed by creating its Lease is known taken only once the operator
    projects it or the owner says it claims (then its share is left to it) or tells: until
    then a thief that took it would only lose the race."""
    clock = [100.0]
    view = QueueView(kube, namespace="ns", queue="q", clock=lambda: clock[0])  # fed by hand: never started
    joined: list[str] = []
    view.peer_listeners.append(joined.append)
    view._on_member("ADDED", {"metadata": {"name": members.lease_name("q", "peer/x")},
                              "spec": {"holderIdentity": "peer/x"}})
    assert joined == ["peer/x"]  # our member Lease's thread hears of it (`Membership.peers_changed`)
    everyone = ["peer/x", "me/x"]
    theirs = [n for n in (f"t-{i}" for i in range(50)) if owner(everyone, n)[1] == "peer/x"][:3]
    mine = next(n for n in (f"m-{i}" for i in range(50)) if owner(everyone, n)[1] == "me/x")

    def task(name: str) -> dict[str, Any]:
        return {"metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}",
                             "creationTimestamp": "2026-01-01T00:00:00Z"}, "spec": {"queue": "q"}}
    view._on_task("ADDED", task(theirs[2]))  # in the first list: not new, nobody is telling of it
    assert [t.name for t, _ in view.choose("me/x", now_utc(), window=8)[0]] == [theirs[2]]
    view._on_task("DELETED", task(theirs[2]))
    view.task_watch.synced.started.set()  # listed (no watch to wait for): what comes now is new
    for name in theirs[:2]:
        view._on_task("ADDED", task(name))
    candidates, division = view.choose("me/x", now_utc(), window=8)
    assert candidates == [] and division.wait_s == pytest.approx(discovery._RIPE_S)
    clock[0] += discovery._RIPE_S - 0.25
    candidates, division = view.choose("me/x", now_utc(), window=8)
    assert candidates == [] and division.wait_s == pytest.approx(0.25)
    view._on_task("ADDED", task(mine))  # our own is ours at once
    assert [t.name for t, _ in view.choose("me/x", now_utc(), window=8)[0]] == [mine]
    view._on_task("DELETED", task(mine))
    # The owner took one and its projection came (Running: an attempt); the other it did not take.
    view._on_task("MODIFIED", {**task(theirs[0]), "status": {"attempt": 1, "phase": "Running"}})
    clock[0] += 0.5
    candidates, division = view.choose("me/x", now_utc(), window=8)
    assert [t.name for t, _ in candidates] == [theirs[1]] and division.ours == 0 and division.wait_s == 0
    # The owner says it claims (the operator is down): it takes its own itself; they leave our index.
    def said(claiming: str, took: str = "[]") -> dict[str, Any]:
        return {"metadata": {"name": members.lease_name("q", "peer/x"),
                             "annotations": {members.ANN_TOOK: took, members.ANN_CLAIMING: claiming}},
                "spec": {"holderIdentity": "peer/x"}}
    view._on_member("MODIFIED", said("true"))
    candidates, division = view.choose("me/x", now_utc(), window=8)
    silent = members.DURATION_S
    assert candidates == [] and silent - 1 < division.wait_s <= silent  # until it would be gone, were it silent
    assert view.claimable_count() == 0
    # It stops claiming and tells what it took: the one it did not take is a thief's again, at once.
    generation = view.generation()
    view._on_member("MODIFIED", said("false", took=f'["{theirs[0]}"]'))
    assert view.generation() > generation and view.claimable_count() == 1
    candidates, division = view.choose("me/x", now_utc(), window=8)
    assert [t.name for t, _ in candidates] == [theirs[1]] and division.owner is Owner.IDLE
    assert joined == ["peer/x"]  # the same member, written again: nobody joined


def test_candidates_kept_from_an_earlier_look_are_not_claimed_once_cancelled(kube: Kube) -> None:
    make_task(kube, "k-0", queue="kept")
    agent = Agent(kube, identity=Identity(pod="kept-agent", instance="a"))
    try:
        agent.claim("kept", timeout=30).complete("done")  # we are a member now: our coming moves nothing later
        view = agent.watch("kept")
        wait_for(lambda: [m.holder for m in view._members.values()] == [agent.identity.holder],
                 message="our own member Lease in our view")
        for name in ("k-1", "k-2", "k-3"):
            make_task(kube, name, queue="kept")
        wait_for(lambda: view.claimable_count() == 3, message="the three tasks in the agent's view")
        first = agent.claim("kept", timeout=30)  # the look offered all three: two are kept for the next claims
        for name in {"k-1", "k-2", "k-3"} - {first.name}:
            kube.merge_patch(TASKS, name, {"spec": {"cancel": True}})
        wait_for(lambda: view.claimable_count() == 0, message="the cancels in the agent's view")
        first.complete("done")
        with pytest.raises(errors.NothingToClaim):
            agent.claim("kept", timeout=1)
    finally:
        agent.close()


@pytest.mark.unit
def test_an_open_task_kept_compact_reads_back_the_same() -> None:
    base = {"metadata": {"name": "t-1", "namespace": "ns", "uid": "u-1", "creationTimestamp": "2026-01-01T00:00:00Z",
                         "resourceVersion": "7", "managedFields": [{"manager": "kubectl"}]},
            "spec": {"queue": "q", "payload": {}, "priority": 0, "maxAttempts": 3, "leaseDurationSeconds": 30,
                     "backoff": {"policy": "Exponential", "initialSeconds": 5, "maxSeconds": 300, "jitter": True},
                     "cancel": False}}
    rich = {**base, "spec": {**base["spec"], "payload": {"a": [1, {"b": None}]}, "priority": 7, "maxAttempts": 1,
                             "deadline": "2026-02-01T00:00:00Z", "cancel": True,
                             "backoff": {"policy": "Exponential", "initialSeconds": 1, "maxSeconds": 300}},
            "status": {"phase": "Pending", "attempt": 2, "result": "x" * 100}}
    for task in (base, rich):
        text = compact(task)
        assert expand(text, name="t-1", namespace="ns") == TaskView.of(task)
    assert len(compact(base)) < 64  # the defaults the API server filled in are not kept


def test_a_member_tells_only_of_claims_the_operator_did_not_project_once_it_stops_claiming(kube: Kube) -> None:
    """The operator's Running projection tells every agent that a task is taken: its claimer
    says it claims, and once it stops (`members.QUIET_S` later) writes only the claims it did
    not see projected, in one write."""
    for name in ("tell-a", "tell-b", "tell-c"):
        make_task(kube, name, queue="tell")
    told: list[str] = []  # every name any member Lease of the queue ever told
    said: list[members.Member] = []

    def heard(kind: str, obj: dict[str, Any]) -> None:
        said.append(members.decode(obj))
        told.extend(said[-1].took)
    tells = Reflector(kube, LEASES, namespace=kube.namespace, label_selector=members.selector("tell"),
                      listener=heard, keep_objects=False)
    tells.start()
    peer = QueueView(kube, namespace=kube.namespace, queue="tell")  # what another agent hears
    peer.start()
    agent = Agent(kube, identity=Identity(pod="tell-agent", instance="a"))
    try:
        projected, *unprojected = (agent.claim("tell", timeout=30) for _ in range(3))
        # As the operator does: Running, with the attempt, before QUIET_S has passed.
        task = kube.get(TASKS, projected.name)
        task["status"] = {"phase": "Running", "attempt": 1}
        kube.replace(TASKS, task, sub="status")
        wait_for(lambda: {t.name for t in unprojected} <= set(told), message="the unprojected claims told")
        assert projected.name not in told
        # Counted when the write has answered: the watch may show it sooner.
        wait_for(lambda: agent.member_writes().told >= 1, message="the tell counted")
        assert agent.member_writes().told == 1
        wait_for(lambda: peer.claimable_count() == 0, message="all three known taken to the peer")
        telling = next(i for i, m in enumerate(said) if m.took)
        assert any(m.claiming and not m.took for m in said[:telling])  # said it claims, told nothing
        assert not said[telling].claiming and said[telling].holder  # told once it stopped claiming
    finally:
        agent.close()
        peer.stop()
        tells.stop()


def test_a_first_claim_waits_until_the_agent_sees_itself_a_member(kube: Kube) -> None:
    """Agents started together would each take the whole queue for theirs: an agent's first
    claim is made once its own member Lease is in its picture, and with it every peer that
    joined before (one watch, in order)."""
    make_task(kube, "j-0", queue="join")
    agent = Agent(kube, identity=Identity(pod="join-agent", instance="a"))
    view = agent.watch("join")
    members_at_claim: list[list[str]] = []
    claim = agent.protocol.claim

    def spying(*args: Any, **kwargs: Any) -> Any:
        members_at_claim.append([m.holder for m in view._members.values()])
        return claim(*args, **kwargs)
    agent.protocol.claim = spying  # type: ignore[method-assign]
    try:
        agent.claim("join", timeout=30).complete("done")
        assert members_at_claim == [[agent.identity.holder]]
    finally:
        agent.close()


def test_an_agent_that_joins_is_a_member_to_its_peers_before_it_claims(kube: Kube) -> None:
    make_task(kube, "jn-0", queue="joined")
    peer = QueueView(kube, namespace=kube.namespace, queue="joined")  # what another agent hears
    peer.start()
    agent = Agent(kube, identity=Identity(pod="joining-agent", instance="a"))
    try:
        view = agent.join("joined")
        assert any(m.holder == agent.identity.holder for m in view._members.values())  # seen itself
        assert peer.wait_for_member(agent.identity.holder, 30), "the peer never counted the joined agent"
        # `join` returns once any of the task watches has a first page (a deep queue lists on in
        # the background): the index holds every candidate once the first list has ended.
        assert view.wait_listed(30), "the queue's first list never ended"
        assert view.claimable_count() == 1 and agent.member_writes().told == 0  # nothing claimed
    finally:
        agent.close()
        peer.stop()


@contextlib.contextmanager
def _member_heard(kube: Kube, queue: str, holder: str,
                  holding: int) -> Iterator[tuple[Membership, list[members.Member]]]:
    """A Membership of `holder` in `queue`, started, and every write of it as its peers hear it."""
    said: list[members.Member] = []
    tells = Reflector(kube, LEASES, namespace=kube.namespace, label_selector=members.selector(queue),
                      listener=lambda kind, obj: said.append(members.decode(obj)), keep_objects=False)
    tells.start()
    member = Membership(MemberLease(kube, namespace=kube.namespace, queue=queue, holder=holder),
                        holder=holder, holding=lambda: holding)
    member.start()
    try:
        yield member, said
    finally:
        member.close()
        tells.stop()


def test_a_claiming_member_tells_what_it_took_at_once_when_a_peer_joins(kube: Kube) -> None:
    """A newcomer takes part of every member's share, and would race for what a claiming
    member took and has not told: the member tells it at once, and goes on claiming."""
    with _member_heard(kube, "joins", "old/x", 2) as (member, said):
        member.took("j-1", created=True, stolen=False)
        member.took("j-2", created=True, stolen=False)
        member.peers_changed("new/x")
        wait_for(lambda: any(m.took for m in said), message="the claims told")
        first = next(m for m in said if m.took)
        # Told while claiming (`QUIET_S` had not passed): the join's write, not the stop's.
        assert first.took == ("j-1", "j-2") and first.claiming and first.holding == 2
        # The writer counts its write once the answer is in: the watch may show it sooner.
        wait_for(lambda: member.writes.told >= 1, message="the tell counted")
        assert member.writes.told == 1


def test_a_member_says_it_waits_once_a_claim_has_waited_a_while_and_not_after(kube: Kube) -> None:
    """A claim that waits takes the member's shards' tasks as they come: once it has waited
    `WAITING_S` its peers hear it (and need not read those shards), a shorter wait says
    nothing, and the first write after the wait ended says it no more."""
    with _member_heard(kube, "waits", "w/x", 0) as (member, said):
        wait_for(lambda: bool(said), message="the member's first write")
        first = len(said)
        member.waiting()()  # a wait that ended at once
        began = time.monotonic()
        ended = member.waiting()
        wait_for(lambda: said[-1].waiting, message="the wait said")
        assert time.monotonic() - began >= members.WAITING_S and len(said) == first + 1  # nothing before
        writes = len(said)
        ended()
        assert not said[-1].claiming  # a wait is no claim: nothing of ours is parked for it
        wait_for(lambda: len(said) > writes, message="the next write, to say it is alive")
        assert not said[-1].waiting


def test_a_band_left_to_a_claiming_peer_holds_our_lower_bands_back(kube: Kube) -> None:
    """Strict priority across agents: a higher band's task whose owner is claiming is left to
    it (out of our index), and we take nothing of a lower band until the owner tells it took
    it; or, once the owner no longer claims, we take it ourselves."""
    view = QueueView(kube, namespace="ns", queue="q")  # fed by hand below: never started
    everyone = ["peer/x", "me/x"]
    urgent = [n for n in (f"u-{i}" for i in range(50)) if owner(everyone, n)[1] == "peer/x"][:2]
    low = next(n for n in (f"l-{i}" for i in range(50)) if owner(everyone, n)[1] == "me/x")

    def task(name: str, priority: int) -> dict[str, Any]:
        return {"metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}",
                             "creationTimestamp": "2026-01-01T00:00:00Z"}, "spec": {"queue": "q", "priority": priority}}

    def said(claiming: str, took: str = "[]") -> dict[str, Any]:
        return {"metadata": {"name": members.lease_name("q", "peer/x"),
                             "annotations": {members.ANN_TOOK: took, members.ANN_CLAIMING: claiming}},
                "spec": {"holderIdentity": "peer/x"}}
    view._on_member("ADDED", said("true"))
    view._on_task("ADDED", task(urgent[0], 10))
    view._on_task("ADDED", task(low, 0))
    candidates, division = view.choose("me/x", now_utc(), window=8)
    assert candidates == [] and division.wait_s > 0 and division.held_back  # nothing lower while it is open
    generation = view.generation()
    view._on_member("MODIFIED", said("true", took=f'["{urgent[0]}"]'))  # it took it, and says so
    assert view.generation() > generation  # a claimer held back wakes up
    assert [t.name for t, _ in view.choose("me/x", now_utc(), window=8)[0]] == [low]

    view._on_task("ADDED", task(urgent[1], 10))
    assert view.choose("me/x", now_utc(), window=8)[0] == []  # held back again
    # Its member Lease deleted and written again, not claiming (an agent restarted under the
    # same name): its share is a thief's, and the urgent task comes first.
    view._on_member("DELETED", said("true"))
    view._on_member("ADDED", said("false"))
    candidates, division = view.choose("me/x", now_utc(), window=8)
    assert [t.name for t, _ in candidates] == [urgent[1]] and division.owner is Owner.IDLE


def test_a_claiming_member_tells_at_once_when_it_moves_down_a_band_or_is_held_back(kube: Kube) -> None:
    """Its peers hold their lower bands back while a task of a higher band may be open: a
    member that moves to a lower band, or is held back from one itself, tells what it took."""
    with _member_heard(kube, "bands", "m/x", 1) as (member, said):
        member.took("b-1", created=True, stolen=False, priority=10)
        member.took("b-2", created=True, stolen=False, priority=0)  # down a band
        wait_for(lambda: any(m.took for m in said), message="the first claims told")
        first = next(m for m in said if m.took)
        assert first.took[0] == "b-1" and first.claiming  # still claiming: not the stop's write
        member.took("b-3", created=True, stolen=False, priority=0)
        member.held_back()
        wait_for(lambda: any("b-3" in m.took for m in said), message="the claim told when held back")
        assert next(m for m in said if "b-3" in m.took).claiming
        wait_for(lambda: member.writes.told >= 2, message="the tells counted")  # as above
        assert member.writes.told == 2


def test_a_theft_is_told_only_if_the_operator_has_not_projected_it_by_then(kube: Kube) -> None:
    """A task taken from another member's share would have its owner and the other thieves
    race for it, but the operator's projection usually tells them first, at no write of ours:
    the thief tells it `THEFT_TELL_S` later, unless it saw the projection meanwhile."""
    with _member_heard(kube, "thefts", "thief/x", 1) as (member, said):
        took_at = time.monotonic()
        member.took("s-1", created=True, stolen=True)
        member.took("s-2", created=True, stolen=True)
        member.seen("MODIFIED", {"metadata": {"name": "s-1"}, "status": {"phase": "Running", "attempt": 1}})
        wait_for(lambda: any(m.took for m in said), message="the unprojected theft told")
        told_at = time.monotonic()
        first = next(m for m in said if m.took)
        assert first.took == ("s-2",) and first.claiming  # still claiming: the theft's write, not the stop's
        assert told_at - took_at >= members.THEFT_TELL_S


def test_a_member_whose_lease_the_operator_expired_is_no_peer_until_it_writes_again(kube: Kube) -> None:
    """A task freed because its holder went silent is divided among the members left at once,
    not left to the silent one until its member Lease lapses (a replacement agent with a new
    name would wait that long); a member that lives after all is a peer again at its next write."""
    view = QueueView(kube, namespace="ns", queue="q")  # fed by hand below: never started
    dead, me = "dead/x", "me/x"

    def said(holder: str) -> dict[str, Any]:
        return {"metadata": {"name": members.lease_name("q", holder),
                             "annotations": {members.ANN_CLAIMING: "true", members.ANN_HOLDING: "1"}},
                "spec": {"holderIdentity": holder}}
    view._on_member("ADDED", said(dead))
    name = next(n for n in (f"t-{i}" for i in range(50)) if owner([dead, me], n)[1] == dead)
    view._on_task("ADDED", {"metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}",
                                         "creationTimestamp": "2026-01-01T00:00:00Z"},
                            "spec": {"queue": "q"}, "status": {"attempt": 1}})
    expired = LeaseRecord(name=name, namespace="ns", queue="q", owner_uid=f"uid-{name}", epoch=1,
                          resource_version="7", history=(models.Attempt(attempt=1, holder=dead, outcome="Expired"),))
    generation = view.generation()
    view._on_lease("ADDED", record.encode(expired))
    assert view.generation() > generation
    candidates, division = view.choose(me, now_utc(), window=8)
    assert [t.name for t, _ in candidates] == [name] and division.ours == 1  # ours: the silent one is no peer
    view._on_member("MODIFIED", said(dead))  # it lives after all
    candidates, division = view.choose(me, now_utc(), window=8)
    assert [t.name for t, _ in candidates] == [name] and division.ours == 0  # its own again


def test_a_lease_freed_otherwise_leaves_its_last_holder_a_peer(kube: Kube) -> None:
    view = QueueView(kube, namespace="ns", queue="q")  # fed by hand below: never started
    peer, me = "peer/x", "me/x"
    view._on_member("ADDED", {"metadata": {"name": members.lease_name("q", peer)}, "spec": {"holderIdentity": peer}})
    name = next(n for n in (f"t-{i}" for i in range(50)) if owner([peer, me], n)[1] == peer)
    view._on_task("ADDED", {"metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}",
                                         "creationTimestamp": "2026-01-01T00:00:00Z"},
                            "spec": {"queue": "q"}, "status": {"attempt": 1}})
    failed = LeaseRecord(name=name, namespace="ns", queue="q", owner_uid=f"uid-{name}", epoch=1,
                         resource_version="7", history=(models.Attempt(attempt=1, holder=peer, outcome="Failed"),))
    view._on_lease("ADDED", record.encode(failed))
    candidates, division = view.choose(me, now_utc(), window=8)
    assert [t.name for t, _ in candidates] == [name] and division.ours == 0


@pytest.mark.unit
def test_a_task_made_again_under_its_name_is_judged_anew_though_told_as_one_event() -> None:
    """A watch that waited out a list tells each name's last event only: the old task's DELETED
    and the new one's ADDED arrive as one ADDED. What was taken of the old one must not hold
    the new one back; a change of the same task keeps it."""
    view = QueueView(_Clockless(), namespace="ns", queue="q")  # type: ignore[arg-type]  # never started

    def task(uid: str, attempt: int = 0) -> dict[str, Any]:
        return {"metadata": {"name": "reborn", "namespace": "ns", "uid": uid,
                             "creationTimestamp": "2026-01-01T00:00:00Z"},
                "spec": {"queue": "q"}, "status": {"attempt": attempt}}
    view._on_task("ADDED", task("uid-1"))
    view.mark_taken("reborn", None)  # claimed by creating its Lease
    view._on_task("MODIFIED", {**task("uid-1"), "spec": {"queue": "q", "priority": 3}})
    assert view.claimable_count() == 0  # the same task, still taken
    view._on_task("ADDED", task("uid-2"))
    assert view.claimable_count() == 1


@pytest.mark.unit
def test_a_free_lease_of_a_task_made_again_that_comes_before_the_old_tasks_deletion_is_kept() -> None:
    """The Task and Lease watches are separate streams: the new task's free Lease (the operator
    gives one when the old task's Lease goes) may reach us before the old task's DELETED. That
    deletion drops the old task's Lease, not the new one's: without it the new task would be
    offered as never claimed, its claim would create a Lease that exists, and nothing more
    would come to correct the picture."""
    view = QueueView(_Clockless(), namespace="ns", queue="q")  # type: ignore[arg-type]  # never started

    def task(uid: str) -> dict[str, Any]:
        return {"metadata": {"name": "reborn", "namespace": "ns", "uid": uid,
                             "creationTimestamp": "2026-01-01T00:00:00Z"}, "spec": {"queue": "q"}}
    view._on_task("ADDED", task("uid-1"))
    view.mark_taken("reborn", None)  # claimed by creating its Lease
    view._on_lease("ADDED", record.encode(LeaseRecord(name="reborn", namespace="ns", queue="q", owner_uid="uid-2",
                                                      resource_version="7")))
    view._on_task("DELETED", task("uid-1"))
    view._on_task("ADDED", task("uid-2"))
    candidates, _ = view.choose("me/x", now_utc(), window=8)
    assert [(t.uid, rec and rec.resource_version) for t, rec in candidates] == [("uid-2", "7")]


@pytest.mark.unit
def test_a_take_learnt_while_its_task_is_not_ours_to_view_holds_when_it_comes_to_us() -> None:
    """Without the operator's projection a taken task stays listed open: a shard that comes to
    us must not bring back as claimable what its viewers told taken while we did not view it,
    nor what we took before it left us. A task made after the tell is another."""
    view = QueueView(_Clockless(), namespace="ns", queue="q")  # type: ignore[arg-type]  # never started

    def task(name: str, created: str = "2026-01-01T00:00:00Z") -> dict[str, Any]:
        return {"metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "creationTimestamp": created},
                "spec": {"queue": "q"}}
    view._on_member("ADDED", {"metadata": {"name": members.lease_name("q", "peer/x"),
                                           "annotations": {members.ANN_TOOK: '["told", "reborn"]'}},
                              "spec": {"holderIdentity": "peer/x"}})
    view._on_task("ADDED", task("mine"))
    view.mark_taken("mine", None)  # claimed by creating its Lease
    view._on_dropped(["mine"])  # its shard went to others
    assert view.claimable_count() == 0
    read = [TaskView.of(task(name)) for name in ("told", "mine", "open")]  # read by a claim before its list ends
    assert [t.name for t in view.claimable(read, now_utc())] == ["open"]
    for name in ("told", "mine", "open"):  # the shards come (back) to us, listed
        view._on_task("ADDED", task(name))
    view._on_task("ADDED", task("reborn", created="2999-01-01T00:00:00Z"))  # made again since
    view._on_member("DELETED", {"metadata": {"name": members.lease_name("q", "peer/x")}, "spec": {}})
    assert sorted(t.name for t, _ in view.choose("me/x", now_utc(), window=8)[0]) == ["open", "reborn"]


@pytest.mark.unit
def test_a_task_that_came_to_us_from_a_claiming_peer_waits_until_it_tells_or_a_moment_passes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """When the members change, tasks move between agents. Without the operator's projection,
    one that moved from a claiming peer may be one it took untold: it is left to that peer
    until the peer writes its member Lease (it tells at once) or `_MOVED_S` passes (it had
    nothing to tell). What came from a peer that does not claim is ours at once."""
    view = QueueView(_Clockless(), namespace="ns", queue="q", holder="me/x")  # type: ignore[arg-type]
    monkeypatch.setattr(view.task_watch, "start", lambda shards: None)  # fed by hand below

    def said(holder: str, claiming: str, took: str = "[]") -> dict[str, Any]:
        return {"metadata": {"name": members.lease_name("q", holder),
                             "annotations": {members.ANN_TOOK: took, members.ANN_CLAIMING: claiming}},
                "spec": {"holderIdentity": holder}}

    def task(name: str) -> dict[str, Any]:
        return {"metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}",
                             "creationTimestamp": "2026-01-01T00:00:00Z"}, "spec": {"queue": "q"}}
    for holder, claiming in (("a/x", "true"), ("c/x", "true"), ("b/x", "false")):
        view._on_member("ADDED", said(holder, claiming))
    before, after = ["a/x", "b/x", "c/x"], ["a/x", "b/x", "c/x", "me/x"]
    came = [n for n in (f"t-{i}" for i in range(400)) if owner(after, n)[1] == "me/x"]
    from_a, from_b, from_c = ([n for n in came if owner(before, n)[1] == p][:2] for p in before)
    view.start_tasks()  # we join: what is ours was theirs
    for name in from_a + from_b + from_c:
        view._on_task("ADDED", task(name))
    now = now_utc()

    def mine(at: Any) -> list[str]:
        return sorted(t.name for t, _ in view.choose("me/x", at, window=64)[0])
    assert mine(now) == sorted(from_b)
    view._on_member("MODIFIED", said("a/x", "true", took=f'["{from_a[0]}"]'))  # a tells
    assert mine(now) == sorted(from_b + from_a[1:])
    assert mine(now + timedelta(seconds=discovery._MOVED_S)) == sorted(from_b + from_a[1:] + from_c)


@pytest.mark.unit
def test_an_agent_with_none_of_its_own_takes_the_far_end_of_a_claiming_peers_backlog_while_claims_are_projected(
) -> None:
    """A claiming peer's tasks are left to it, but not to the last while we idle beside its
    backlog: with the operator projecting claims (what it takes leaves our picture at once),
    we take the one it comes to last (it takes its own heaviest first), while it has
    `_TAIL_LEFT` left."""
    clock = [100.0]
    view = QueueView(_Clockless(), namespace="ns", queue="q", clock=lambda: clock[0])  # type: ignore[arg-type]
    names = [f"t-{i}" for i in range(6)]

    def task(i: int, phase: str = "") -> dict[str, Any]:
        return {"metadata": {"name": names[i], "namespace": "ns", "uid": f"uid-{i}",
                             "creationTimestamp": f"2026-01-01T00:00:0{i}Z"},
                "spec": {"queue": "q"}, "status": {"phase": phase, "attempt": 1 if phase else 0}}
    view._on_member("ADDED", {"metadata": {"name": members.lease_name("q", "peer/x"),
                                           "annotations": {members.ANN_CLAIMING: "true"}},
                              "spec": {"holderIdentity": "peer/x", "leaseDurationSeconds": 60}})
    everyone = ["peer/x", "me/x"]
    while [n for n in names if owner(everyone, n)[1] != "peer/x"]:  # all the peer's
        names = [f"{n}x" if owner(everyone, n)[1] != "peer/x" else n for n in names]
    for i in range(6):
        view._on_task("ADDED", task(i))

    def look() -> tuple[list[str], Owner | None]:
        candidates, division = view.choose("me/x", now_utc(), window=8)
        return [t.name for t, _ in candidates], division.owner
    assert look() == ([], None)  # no claim projected yet: what the peer took may look open
    view._on_task("MODIFIED", task(0, phase="Running"))  # the operator projects the peer's claim
    clock[0] += discovery._PROJECTED_S + 1
    assert look() == ([], None)  # none projected for a while: it may have taken more, untold
    view._on_task("MODIFIED", task(0, phase="Running"))
    lightest = sorted(names[1:], key=lambda n: weight("peer/x", n))
    for name in lightest[:2]:
        assert look() == ([name], Owner.CLAIMING)
        view.mark_taken(name, None)
    assert look() == ([], None)  # three left: they are the peer's


class _Clockless:
    """What a QueueView fed by hand reads of its Kube."""

    namespace = "ns"

    def now(self) -> Any:
        return now_utc()


@pytest.mark.unit
def test_before_the_list_ends_a_claim_is_offered_only_what_its_leases_allow_its_own_first() -> None:
    """`unlisted`: tasks read from the API server (best first) are judged with the free
    Leases the view knows and what it saw taken, and divided among the members as `choose` does."""
    view = QueueView(_Clockless(), namespace="ns", queue="q")  # type: ignore[arg-type]  # never started

    def task(name: str, attempt: int = 0) -> TaskView:
        return TaskView.of({"metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}",
                                         "creationTimestamp": "2026-01-01T00:00:00Z"},
                            "spec": {"queue": "q"}, "status": {"attempt": attempt}})
    view._on_lease("ADDED", record.encode(LeaseRecord(name="retried", namespace="ns", queue="q",
                                                      owner_uid="uid-retried", epoch=1, resource_version="5")))
    view.mark_taken("lost", None)  # a race lost a moment ago
    peers = ["me/x", "peer/x"]
    view._on_member("ADDED", {"metadata": {"name": members.lease_name("q", "peer/x")},
                              "spec": {"holderIdentity": "peer/x", "leaseDurationSeconds": 60}})
    names = [f"t-{i}" for i in range(16)]
    tasks = [task("held", attempt=1), task("lost"), task("retried", attempt=1), *map(task, names)]
    candidates, division = view.unlisted(tasks, "me/x", now_utc())
    offered = [t.name for t, _ in candidates]
    ours = [n for n in ["retried", *names] if owner(peers, n)[1] == "me/x"]
    assert division.ours == len(ours) and sorted(offered) == sorted(ours)
    assert {"held", "lost"}.isdisjoint(offered)
    retried = [rec for t, rec in candidates if t.name == "retried"]
    assert not retried or (retried[0] is not None and retried[0].resource_version == "5")  # claimed on its free Lease


@pytest.mark.unit
def test_a_task_kept_compact_keeps_its_uid_in_sixteen_bytes() -> None:
    uid = "0b0f3c52-7f3e-4a5e-9d7c-2a8f2c1d9e10"
    task = {"metadata": {"name": "t", "namespace": "ns", "uid": uid, "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"queue": "q"}, "status": {"phase": "Pending"}}
    assert expand(compact(task), name="t", namespace="ns") == TaskView.of(task)
    assert len(compact(task)) < 2 + 16 + 20 + 40


@pytest.mark.unit
def test_the_index_keeps_one_live_entry_per_task_and_orders_a_recreated_task_by_its_new_age() -> None:
    index = CandidateIndex()
    index.add("a", 0, "2026-01-01T00:00:01Z")
    index.add("b", 0, "2026-01-01T00:00:02Z")
    assert not index.add("a", 0, "2026-01-01T00:00:01Z")  # the same: nothing new
    index.add("a", 5, "2026-01-01T00:00:01Z")  # its priority moved: its old entry is stale
    assert index.best(8) == ["a"] and index.priority("a") == 5
    index.discard("a")
    index.add("a", 0, "2026-01-01T00:00:03Z")  # deleted and created again under its name
    assert index.best(8) == ["b", "a"] and len(index) == 2


@pytest.mark.unit
def test_the_index_offers_a_task_dropped_and_added_again_in_its_second_once() -> None:
    """Tasks created in the same second share a list; a dropped one stays in it until a look
    passes it: added again, it is there twice, and offered once."""
    index = CandidateIndex()
    for name in ("b", "a", "c"):
        index.add(name, 0, "2026-01-01T00:00:01Z")
    index.discard("b")
    index.add("b", 0, "2026-01-01T00:00:01Z")
    index.add("c", 3, "2026-01-01T00:00:01Z")  # to another band and back
    index.add("c", 0, "2026-01-01T00:00:01Z")
    assert index.best(8) == ["a", "b", "c"] and len(index) == 3
    index.discard("a")
    assert index.best(1) == ["b"] and index.best(8) == ["b", "c"]


@pytest.mark.unit
def test_the_task_watch_keeps_no_store_of_its_own_and_a_relist_still_finds_what_vanished() -> None:
    """The view keeps every open task's name: the watch asks it (`known`) instead of keeping them twice."""
    class Pages:
        namespace = "ns"
        listed = [["a", "b"], ["a"]]

        def list_pages(self, *args: Any, **kwargs: Any) -> Iterator[dict[str, Any]]:
            names = self.listed.pop(0)
            yield {"metadata": {"resourceVersion": "9"}, "items": [
                {"metadata": {"name": n, "namespace": "ns", "uid": f"uid-{n}", "creationTimestamp":
                              "2026-01-01T00:00:00Z", "resourceVersion": "9"}, "spec": {"queue": "q"}} for n in names]}

        def now(self) -> Any:
            return now_utc()
    view = QueueView(Pages(), namespace="ns", queue="q")  # type: ignore[arg-type]  # never started
    wide = view.task_watch.reflectors()[0]  # the fake lists the same for every selector
    wide._relist()
    assert view.claimable_count() == 2 and wide.store == {} and view.task_watch.has("b")
    wide._relist()  # "b" was deleted while the watch was away
    assert view.claimable_count() == 1 and not view.task_watch.has("b")


@pytest.mark.unit
def test_a_task_listed_again_unchanged_is_not_decoded_again_and_a_changed_one_is(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A list made again (after the API server cut one short) brings every task again: one held
    as it is listed is no news; one that changed meanwhile is judged again."""
    def listed(priority_of_b: int) -> list[dict[str, Any]]:
        return [{"metadata": {"name": n, "namespace": "ns", "uid": f"uid-{n}", "creationTimestamp":
                              "2026-01-01T00:00:00Z", "resourceVersion": "9"},
                 "spec": {"queue": "q", "priority": priority_of_b if n == "b" else 0}} for n in ("a", "b")]

    class Pages:
        namespace = "ns"
        pages = [listed(0), listed(0), listed(5)]

        def list_pages(self, *args: Any, **kwargs: Any) -> Iterator[dict[str, Any]]:
            yield {"metadata": {"resourceVersion": "9"}, "items": self.pages.pop(0)}

        def now(self) -> Any:
            return now_utc()
    decoded: list[str] = []
    of = TaskView.of
    monkeypatch.setattr(discovery.TaskView, "of", staticmethod(lambda obj: decoded.append(obj["metadata"]["name"])
                                                               or of(obj)))
    view = QueueView(Pages(), namespace="ns", queue="q")  # type: ignore[arg-type]  # never started
    seen: list[str] = []
    view.task_listeners.append(lambda kind, obj: seen.append(f"{kind} {obj['metadata']['name']}"))
    wide = view.task_watch.reflectors()[0]  # the fake lists the same for every selector
    wide._relist()
    assert decoded == ["a", "b"] and view.claimable_count() == 2
    wide._relist()  # the same again
    assert decoded == ["a", "b"] and view.claimable_count() == 2
    wide._relist()  # "b" moved to a higher band meanwhile
    assert decoded == ["a", "b", "b"] and view.choose("me/x", now_utc(), window=8)[0][0][0].name == "b"
    assert seen == ["ADDED a", "ADDED b"] * 3  # the listeners are told of each, news or not

"""The agent SDK against a real API server and operator: fencing, pauses, restarts."""

from __future__ import annotations

from dataclasses import replace
import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT, Cluster, Operator, Process, make_task, tasklease_cmd, wait_for
from tasklease.agent import Agent, ClaimedTask, Identity
from tasklease.agent.discovery import task_selector
from tasklease.agent.division import owner, weight
from tasklease.agent.settings import AgentSettings
from tasklease.api import errors, models
from tasklease.api.timestamps import now_utc
from tasklease.kube import JSON, LEASES, TASKS, Kube
from tasklease.protocol import Held, Protocol, TaskView, members, record
from tasklease.protocol.rules import Blocker, blocker

FAST = {"leaseDurationSeconds": 5, "backoff": {"initialSeconds": 0, "maxSeconds": 0}}


def _lines(proc: Process) -> list[dict[str, object]]:
    return [json.loads(line) for line in proc.output().splitlines() if line.startswith("{")]


def test_a_paused_holder_is_expired_and_its_late_writes_are_rejected(
        cluster: Cluster, kube: Kube, namespace: str, operator: Operator, tmp_path: Path) -> None:
    make_task(kube, "paused", queue="p", **FAST)
    go = tmp_path / "go"
    config = cluster.namespaced_kubeconfig(namespace, tmp_path)
    holder = Process([sys.executable, str(ROOT / "tests" / "agents" / "hold.py"), str(config), "p", str(go)],
                     log=tmp_path / "hold.log", env={"POD_NAME": "pausing-agent"})
    claimed = wait_for(lambda: _lines(holder), timeout=30, message="the holder to claim")[0]
    assert claimed["epoch"] == 1

    holder.kill(signal.SIGSTOP)
    try:
        other = Agent(kube, identity=Identity(pod="other-agent", instance="b"))
        stolen = other.claim("p", timeout=30)  # possible only after the operator expired attempt 1
        assert stolen.epoch == 2
        holder.kill(signal.SIGCONT)
        go.touch()
        report = wait_for(lambda: _lines(holder)[1:], timeout=30, message="the paused holder's report")[0]
        assert report["lost"] is True  # its own renew deadline passed while it was stopped
        assert report["renew"] == "LostLease"  # and the API server refused its writes
        assert report["complete"] == "LostLease"
        stolen.complete("fresh result")
        other.close()
    finally:
        holder.kill(signal.SIGCONT)
        holder.stop()

    rec = record.decode(kube.get(LEASES, "paused"))
    assert (rec.outcome, rec.epoch, rec.result) == ("Succeeded", 2, "fresh result")
    assert [(a.attempt, a.outcome) for a in rec.history] == [(1, "Expired"), (2, "Succeeded")]
    status = wait_for(lambda: (kube.get(TASKS, "paused").get("status") or {}).get("phase") == "Succeeded"
                      and kube.get(TASKS, "paused")["status"], message="status Succeeded")
    assert status["result"] == "fresh result"


def test_a_restarted_agent_releases_its_previous_instances_leases_at_once(
        cluster: Cluster, kube: Kube, namespace: str, tmp_path: Path) -> None:
    make_task(kube, "held-long", queue="r", leaseDurationSeconds=300)
    config = str(cluster.namespaced_kubeconfig(namespace, tmp_path))
    first = Process([sys.executable, str(ROOT / "tests" / "agents" / "hold.py"), config, "r", str(tmp_path / "never")],
                    log=tmp_path / "first.log", env={"POD_NAME": "worker-0"})
    claimed = wait_for(lambda: _lines(first), timeout=30, message="the first instance to claim")[0]
    first.kill(signal.SIGKILL)
    first.wait(10)

    started = time.monotonic()
    second = Process(tasklease_cmd("run", f"--kubeconfig={config}", "--queue", "r", "--", "echo", "second"),
                     log=tmp_path / "second.log", env={"POD_NAME": "worker-0"})
    assert second.wait(60) == 0, second.output()
    assert time.monotonic() - started < 30  # not the 300 s lease duration
    rec = record.decode(kube.get(LEASES, "held-long"))
    assert [(a.attempt, a.outcome) for a in rec.history] == [(1, "Released"), (2, "Succeeded")]
    assert rec.history[0].holder == claimed["holder"]
    assert rec.history[1].holder.startswith("worker-0/") and rec.history[1].holder != claimed["holder"]
    assert "restarted" in rec.history[0].message
    assert rec.result == "second"


def test_tasklease_run_leaves_its_queue_on_exit(cluster: Cluster, kube: Kube, namespace: str,
                                                tmp_path: Path) -> None:
    make_task(kube, "one", queue="leaving")
    config = str(cluster.namespaced_kubeconfig(namespace, tmp_path))
    run = Process(tasklease_cmd("run", f"--kubeconfig={config}", "--queue", "leaving", "--wait", "30", "--", "true"),
                  log=tmp_path / "run.log", env={"POD_NAME": "leaver-0"})
    assert run.wait(60) == 0, run.output()
    assert kube.list(LEASES, label_selector=members.selector("leaving"))["items"] == []  # its member Lease is gone


def test_fencing_epoch_only_grows_and_stale_holders_are_refused(kube: Kube) -> None:
    make_task(kube, "fenced", queue="f", maxAttempts=5, backoff={"initialSeconds": 0, "maxSeconds": 0})
    agents = [Agent(kube, identity=Identity(pod=f"a{i}", instance="x")) for i in range(3)]
    epochs = []
    stale = []
    for agent in agents:
        task = agent.claim("f", timeout=30)
        epochs.append(task.epoch)
        stale.append(task.held)
        task.release()
    assert epochs == [1, 2, 3]
    final = agents[0].claim("f", timeout=30)
    for held in stale:
        with pytest.raises(errors.LostLease):
            agents[0].protocol.complete(held, "stale")
    final.complete("current")
    assert record.decode(kube.get(LEASES, "fenced")).result == "current"
    for a in agents:
        a.close()


def test_a_leases_field_managers_are_tracked_at_its_create_only(kube: Kube) -> None:
    """Tracking managedFields is the costliest step of a Lease write (`record.encode_patch`):
    after the claim that creates a task's Lease, every write leaves it with none (the
    release's PUT, the next claim's merge patch, the completion), and the writes still say
    what they should."""
    make_task(kube, "untracked", queue="u", maxAttempts=3, backoff={"initialSeconds": 0, "maxSeconds": 0})
    agent = Agent(kube, identity=Identity(pod="a", instance="x"))
    try:
        def managers() -> list[object]:
            return list(kube.get(LEASES, "untracked")["metadata"].get("managedFields") or [])
        first = agent.claim("u", timeout=30)
        assert managers()  # a create is tracked
        first.release()
        assert managers() == []
        second = agent.claim("u", timeout=30)
        assert second.epoch == 2 and managers() == []
        second.complete("done")
        assert managers() == [] and record.decode(kube.get(LEASES, "untracked")).result == "done"
    finally:
        agent.close()


def test_a_lost_lease_reaches_work_in_another_thread_as_a_token(kube: Kube) -> None:
    make_task(kube, "interrupted", queue="i", leaseDurationSeconds=5)
    agent = Agent(kube, identity=Identity(pod="busy", instance="x"))
    outcome: list[str] = []

    def work() -> None:
        with agent.claim("i", timeout=30) as task:
            outcome.append("claimed")
            _requeue_now(kube, "interrupted")
            if task.lost.wait(30):  # the work watches its token: nothing is raised into it
                outcome.append("told")
            try:
                task.check()
            except errors.LostLease:
                outcome.append("checked")

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert outcome == ["claimed", "told", "checked"]
    agent.close()


def test_a_work_loop_installs_no_signal_handler_and_goes_on_after_a_lost_task(kube: Kube) -> None:
    make_task(kube, "kept-a", queue="k", **FAST)
    make_task(kube, "kept-b", queue="k", **FAST)
    agent = Agent(kube, identity=Identity(pod="looping", instance="x"))
    before = signal.getsignal(signal.SIGUSR1)
    handlers: list[object] = []
    lost: list[str] = []

    def handler(task: ClaimedTask) -> str:
        handlers.append(signal.getsignal(signal.SIGUSR1))
        if task.name == "kept-a" and task.epoch == 1:
            _requeue_now(kube, task.name)
            assert task.lost.wait(30)
            lost.append(task.name)
            task.check()
        return "ok"

    with agent:
        assert agent.work("k", handler, max_tasks=2, idle_timeout=30) == 2
    assert lost == ["kept-a"]
    assert handlers == [before] * 3
    assert record.decode(kube.get(LEASES, "kept-a")).epoch == 2


def test_close_wakes_a_waiting_claim_releases_what_it_holds_and_leaves_the_queue(kube: Kube) -> None:
    make_task(kube, "held-on-close", queue="c")
    agent = Agent(kube, identity=Identity(pod="closing", instance="x"))
    task = agent.claim("c", timeout=30)
    waited: list[BaseException] = []

    def wait() -> None:
        try:
            agent.claim("c")  # nothing else to claim: waits until the agent closes
        except errors.NothingToClaim as exc:
            waited.append(exc)
    thread = threading.Thread(target=wait)
    thread.start()
    member = members.lease_name("c", agent.identity.holder)
    wait_for(lambda: kube.get_or_none(LEASES, member) is not None, message="the member Lease")
    agent.close()
    thread.join(30)
    assert not thread.is_alive() and "closed" in str(waited[0])
    assert task.finished and record.decode(kube.get(LEASES, "held-on-close")).state == record.FREE
    assert kube.get_or_none(LEASES, member) is None
    with pytest.raises(errors.NothingToClaim):
        agent.claim("c", timeout=1)


def test_close_ends_the_watch_threads_at_once_on_a_quiet_queue(kube: Kube) -> None:
    """A quiet watch's thread blocks in a read until the next event, a bookmark a minute
    later; `close()` hangs its response up instead."""
    before = set(threading.enumerate())
    agent = Agent(kube, identity=Identity(pod="quiet", instance="x"))
    view = agent.join("quiet")
    wait_for(lambda: view.listed, message="the queue listed")  # every watch is past its list
    watching = [t for t in threading.enumerate() if t not in before and t.name.startswith("watch-")]
    # The queue's free Leases and members; its Tasks (those of other bands, those without a shard,
    # the shards it views: all, alone), each with the watch opened before its list; its TaskQueue
    # (the gate), listed before the first claim needs it.
    assert sorted(t.name for t in watching) == (["watch-leases"] * 2 + ["watch-taskqueues"] + ["watch-tasks"] * 3
                                                + ["watch-tasks-pinned"] * 3)
    agent.close()
    wait_for(lambda: not any(t.is_alive() for t in watching), timeout=5, message="the watch threads to end")


def _requeue_now(kube: Kube, name: str) -> None:
    protocol = Protocol(kube)
    protocol.requeue(TaskView.of(kube.get(TASKS, name)), protocol.read(kube.namespace, name))


def test_agents_in_two_containers_of_one_pod_release_only_their_own_dead_instances(
        kube: Kube, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAME", "two-containers")
    monkeypatch.setenv("TASKLEASE_AGENT_ID", "left")
    for name in ("left-task", "right-task"):
        make_task(kube, name, queue=name)
    # Both instances look dead from here; only the left one is in this container.
    for container in ("left", "right"):
        gone = Agent(kube, identity=Identity(pod="two-containers", instance=f"{container}:999999.1.dead"))
        gone.claim(f"{container}-task", timeout=30).detach()
        gone.close()
    newcomer = Agent(kube)
    assert newcomer.identity.holder.startswith("two-containers/left:")  # the pod part is the pod's name
    assert newcomer.start() == ["left-task"]
    assert record.decode(kube.get(LEASES, "right-task")).holder == "two-containers/right:999999.1.dead"
    newcomer.close()

    monkeypatch.setenv("TASKLEASE_AGENT_ID", "left/right")
    with pytest.raises(errors.Invalid, match="TASKLEASE_AGENT_ID"):
        Agent(kube)


def test_a_restarting_agent_leaves_a_live_sibling_alone(kube: Kube, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAME", "shared-pod")
    monkeypatch.setenv("POD_UID", "uid-now")
    make_task(kube, "sibling", queue="s")
    make_task(kube, "orphan", queue="s2")
    make_task(kube, "inherited", queue="s3")
    sibling = Agent(kube)  # this very process: alive
    held = sibling.claim("s", timeout=30)
    assert held.holder.startswith("shared-pod/") and held.holder.endswith("@uid-now")
    dead = Agent(kube, identity=Identity(pod="shared-pod", instance="999999.1.dead", pod_uid="uid-now"))
    dead.claim("s2", timeout=30).detach()  # a predecessor whose process is gone
    # An earlier pod of the same name (a StatefulSet's): its process looks alive here (the same
    # pid and start time as ours), but its pod uid says it is gone.
    earlier = Agent(kube, identity=replace(sibling.identity, pod_uid="uid-before"))
    earlier.claim("s3", timeout=30).detach()
    newcomer = Agent(kube)
    assert sorted(newcomer.start()) == ["inherited", "orphan"]
    assert record.decode(kube.get(LEASES, "sibling")).holder == held.holder
    held.complete("still mine")
    for a in (sibling, dead, earlier, newcomer):
        a.close()


def test_a_completion_retried_after_its_answer_was_lost_counts_once(kube: Kube) -> None:
    make_task(kube, "retried", queue="retry")
    agent = Agent(kube, identity=Identity(pod="flaky-network", instance="x"))
    task = agent.claim("retry", timeout=30)
    before = task.held
    agent.protocol.complete(before, "the result")
    # The same completion again, as after a timeout: the write was applied, so it succeeds.
    agent.protocol.complete(before, "the result")
    with pytest.raises(errors.LostLease):
        agent.protocol.complete(before, "another result")  # a different outcome is not ours to write
    assert record.decode(kube.get(LEASES, "retried")).result == "the result"
    task.detach()
    agent.close()


def test_the_queue_selector_drops_exactly_the_finished_tasks(kube: Kube) -> None:
    """The server-side Task selector agents watch with, case by case against `blocker`."""
    expected = {}
    for phase in models.Phase:
        name = f"in-{phase.value.lower()}"
        task = make_task(kube, name, queue="sel")
        task["status"] = {"phase": phase.value}
        kube.replace(TASKS, task, sub="status")
        expected[name] = blocker(TaskView.of(kube.get(TASKS, name)), None, now_utc()) is not Blocker.FINISHED
    listed = {t["metadata"]["name"] for t in kube.list(TASKS, field_selector=task_selector("sel"))["items"]}
    assert {name: name in listed for name in expected} == expected
    assert not all(expected.values()) and any(expected.values())


def test_an_ending_whose_answer_is_lost_is_retried_and_counts_once(kube: Kube) -> None:
    """The completion reaches the API server but its answer is lost (a network error): the SDK
    retries, finds its own outcome already applied, and succeeds, with one result recorded."""
    make_task(kube, "blip", queue="blip")
    agent = Agent(kube)
    try:
        task = agent.claim("blip", timeout=30)
        real = task.protocol.complete
        calls: list[str] = []

        def answer_lost_once(held: Held, result: str) -> Held:
            calls.append(result)
            written = real(held, result)
            if len(calls) == 1:
                raise errors.Unreachable("cannot reach the Kubernetes API server: connection reset")
            return written
        task.protocol.complete = answer_lost_once  # type: ignore[method-assign]
        with task:
            task.complete("done")
        assert calls == ["done", "done"]
        rec = record.decode(kube.get(LEASES, "blip"))
        assert (rec.outcome, rec.result, [a.outcome for a in rec.history]) == ("Succeeded", "done", ["Succeeded"])
    finally:
        agent.close()


def _hold_the_task_list(kube: Kube, queue: str) -> tuple[threading.Event, list[int]]:
    """The agent's first list of `queue`'s Tasks (a streaming list) waits for the event
    returned; the Task LISTs it makes (its reads of the best tasks before that list ends) are
    counted."""
    release, reads = threading.Event(), [0]
    watch, request = kube.watch, kube.request

    def held(res: Any, **kwargs: Any) -> Iterator[JSON]:
        if res is TASKS and kwargs.get("field_selector") == task_selector(queue) and kwargs.get("initial_events"):
            assert release.wait(60), "the test never released the list"
        yield from watch(res, **kwargs)

    def counted(method: str, path: str, **kwargs: Any) -> JSON:
        # A read's first page: a LIST of the queue's Tasks with no label selector (the reads
        # beside and after it select by rank), not the version read before the list (one
        # object, unselected).
        query = kwargs.get("query") or {}
        reads[0] += (path == TASKS.path(kube.namespace) and "limit" in query and "labelSelector" not in query
                     and "fieldSelector" in query)
        return request(method, path, **kwargs)
    kube.watch = held  # type: ignore[method-assign]
    kube.request = counted  # type: ignore[method-assign]
    return release, reads


def _a_round_lost_to(kube: Kube, peer: str, *, then: Callable[[], None] = lambda: None) -> list[str]:
    """A whole round of claims lost: the next `tries_per_look` Leases an agent creates through
    `kube` are each created first by `peer`. `then` runs once, after the last of them, before
    the agent's own request. Returns the names taken so, as they are taken."""
    request = kube.request
    beaten: list[str] = []

    def peer_first(method: str, path: str, **kwargs: Any) -> JSON:
        body = kwargs.get("body") or {}
        labels = (body.get("metadata") or {}).get("labels") or {}
        if method == "POST" and path == LEASES.path(kube.namespace) and labels.get(record.LABEL_MANAGED) \
                and len(beaten) < AgentSettings().tries_per_look:
            taken = json.loads(json.dumps(body))
            taken["spec"]["holderIdentity"] = peer
            taken["metadata"]["labels"][record.LABEL_HOLDER_POD] = record.holder_pod(peer)
            request(method, path, **{**kwargs, "body": taken})
            beaten.append(body["metadata"]["name"])
            if len(beaten) == AgentSettings().tries_per_look:
                then()
        return request(method, path, **kwargs)
    kube.request = peer_first  # type: ignore[method-assign]
    return beaten


def test_before_its_list_ends_one_read_of_the_best_tasks_serves_many_claims(kube: Kube) -> None:
    """Each read of the best tasks costs the API server a scan of the queue: an agent started
    at a deep queue claims what one read found of its own, one claim after the other."""
    for i in range(12):
        make_task(kube, f"early-{i:02d}", queue="early")
    release, reads = _hold_the_task_list(kube, "early")
    agent = Agent(kube, identity=Identity(pod="early-agent", instance="a"))
    try:
        done = []
        for _ in range(10):
            task = agent.claim("early", timeout=30)
            task.complete("ok")
            done.append(task.name)
        assert not release.is_set() and reads[0] == 1
        assert len(set(done)) == 10
    finally:
        release.set()
        agent.close()


def test_before_its_list_ends_an_agent_that_won_a_claim_reads_the_best_tasks_no_more(kube: Kube) -> None:
    """While many agents list a deep queue, each read of its best tasks is one more scan of it
    beside their lists, and most of what it finds a peer has taken already: once an agent has
    won a claim so, what that read kept is all, and its next claim waits for the list."""
    for i in range(6):
        make_task(kube, f"spent-{i:02d}", queue="spent")
    release, reads = _hold_the_task_list(kube, "spent")
    agent = Agent(kube, identity=Identity(pod="spent-agent", instance="a"), settings=AgentSettings(early_reads=4))
    try:
        done = []
        for _ in range(4):  # what the one read found
            task = agent.claim("spent", timeout=30)
            task.complete("ok")
            done.append(task.name)
        assert sorted(done) == [f"spent-{i:02d}" for i in range(4)] and reads[0] == 1
        claimed: list[ClaimedTask] = []
        waiting = threading.Thread(target=lambda: claimed.append(agent.claim("spent", timeout=30)))
        waiting.start()
        waiting.join(2)
        assert waiting.is_alive() and reads[0] == 1, "the agent read the queue again before its list ended"
        release.set()
        waiting.join(30)
        assert claimed and claimed[0].name in ("spent-04", "spent-05") and reads[0] == 1
        claimed[0].complete("ok")
    finally:
        release.set()
        agent.close()


def test_before_its_list_ends_a_lost_round_is_judged_again_from_the_same_read(kube: Kube) -> None:
    """An agent that loses its first picks to peers (they count fewer members, so some of its
    tasks are theirs too) tries the rest of the same read, judged again: another read would
    take seconds at a deep queue while every agent lists it."""
    for i in range(12):
        make_task(kube, f"lost-{i:02d}", queue="lost")
    release, reads = _hold_the_task_list(kube, "lost")
    beaten = _a_round_lost_to(kube, "peer-pod/1")
    agent = Agent(kube, identity=Identity(pod="lost-agent", instance="a"))
    try:
        task = agent.claim("lost", timeout=30)
        assert len(beaten) == AgentSettings().tries_per_look and task.name not in beaten
        assert not release.is_set() and reads[0] == 1, "a lost round read the queue again"
        task.complete("ok")
    finally:
        release.set()
        agent.close()


def _peers_seen_late(me: str, names: list[str], *, tries: int, kept_before: int) -> list[str]:
    """Seven peers by whom none of `names[:kept_before]` is `me`'s, but one of the rest is,
    and not one of the `tries` that `me`, alone at first, tries first (its highest weights)."""
    first = set(sorted(names, key=lambda name: weight(me, name), reverse=True)[:tries])
    for k in range(10_000):
        peers = [Identity(pod=f"late-peer-{k}-{i}", instance="1").holder for i in range(7)]

        def mine(name: str, peers: list[str] = peers) -> bool:
            return owner([me, *peers], name)[1] == me
        if not any(map(mine, names[:kept_before])) and any(mine(n) for n in names[kept_before:] if n not in first):
            return peers
    raise AssertionError("no such peers")


def test_before_its_list_ends_a_round_lost_to_peers_seen_late_finds_its_own_in_the_same_read(kube: Kube) -> None:
    """Agents started together count different members at first. An agent whose first round
    is lost, and which then sees seven peers, judges the whole read again by all eight: its
    own tasks are among the read's later ones here, and it claims one of them instead of
    reading the queue again (seconds at a deep queue while every agent lists it)."""
    names = [f"late-{i:02d}" for i in range(40)]
    for name in names:
        make_task(kube, name, queue="late")
    release, reads = _hold_the_task_list(kube, "late")
    identity = Identity(pod="late-agent", instance="a")
    tries = AgentSettings().tries_per_look
    peers = _peers_seen_late(identity.holder, names, tries=tries, kept_before=AgentSettings().best_of)
    agent = Agent(kube, identity=identity)

    def peers_join() -> None:  # and the agent sees them before its next round
        view = agent.watch("late")
        for holder in peers:
            members.MemberLease(kube, namespace=kube.namespace, queue="late", holder=holder).write([], 0)
            assert view.wait_for_member(holder, 30)
    beaten = _a_round_lost_to(kube, peers[0], then=peers_join)
    try:
        task = agent.claim("late", timeout=30)
        assert len(beaten) == tries and task.name not in beaten
        assert owner([identity.holder, *peers], task.name)[1] == identity.holder
        assert not release.is_set() and reads[0] == 1, "the agent read the queue again"
        task.complete("ok")
    finally:
        release.set()
        agent.close()


def test_a_first_claim_reads_the_best_tasks_while_its_agent_joins_the_queue(kube: Kube) -> None:
    """Joining (the member Lease written, then seen) and reading the best tasks are the first
    claim's two slow steps at a deep queue; only judging what the read found needs the join,
    so the read does not wait for it. The member Lease's creation is held here until the read
    has begun (the join would wait up to a minute to see it)."""
    make_task(kube, "joined", queue="joining")
    release, _ = _hold_the_task_list(kube, "joining")
    read_began = threading.Event()
    held: list[bool] = []  # whether the read began while the member Lease's creation was held
    request = kube.request

    def observed(method: str, path: str, **kwargs: Any) -> JSON:
        body = kwargs.get("body") or {}
        labels = (body.get("metadata") or {}).get("labels") or {}
        if method == "POST" and path == LEASES.path(kube.namespace) and members.LABEL_AGENT_OF in labels:
            held.append(read_began.wait(30))
        elif method == "GET" and path == TASKS.path(kube.namespace) and "limit" in (kwargs.get("query") or {}):
            read_began.set()
        return request(method, path, **kwargs)
    kube.request = observed  # type: ignore[method-assign]
    agent = Agent(kube, identity=Identity(pod="joining-agent", instance="a"), settings=AgentSettings(join_s=60))
    try:
        task = agent.claim("joining", timeout=30)
        assert held == [True], "the read of the best tasks waited for the join"
        assert task.name == "joined" and not release.is_set()
        task.complete("ok")
    finally:
        release.set()
        agent.close()


def test_a_claim_timeout_does_not_end_before_the_queue_is_listed(kube: Kube) -> None:
    """Before its list ends, an agent cannot tell that a deep queue holds nothing for it: a
    timeout then would stop a worker (`idle_timeout`) beside open work."""
    make_task(kube, "only", queue="listed")
    release, _ = _hold_the_task_list(kube, "listed")
    agent = Agent(kube, identity=Identity(pod="listing-agent", instance="a"))
    outcome: list[BaseException] = []
    try:
        held = agent.claim("listed", timeout=30)

        def claim_more() -> None:
            try:
                agent.claim("listed", timeout=0.2)
            except errors.NothingToClaim as exc:
                outcome.append(exc)
        waiting = threading.Thread(target=claim_more, daemon=True)
        waiting.start()
        waiting.join(2.0)  # ten times its timeout
        assert waiting.is_alive() and not outcome
        release.set()
        waiting.join(30)
        assert not waiting.is_alive() and len(outcome) == 1
        held.complete("ok")
    finally:
        release.set()
        agent.close()

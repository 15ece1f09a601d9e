"""Agents of one queue against a real API server: each watches the tasks of the shards it
views, and what their watches leave out is still claimed, in strict priority."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest

from conftest import wait_for
from tasklease.agent import Agent, Identity
from tasklease.agent.discovery import QueueView
from tasklease.agent.division import viewers
from tasklease.kube import JSON, LEASES, TASKS, Kube
from tasklease.protocol import record
from tasklease.protocol.labels import LABEL_SHARD, labelled, shard_of


def _create(kube: Kube, name: str, queue: str, labels: dict[str, str] | None = None, **spec: object) -> JSON:
    """A Task as producers create it: with its rank and shard labels (`labels` first)."""
    return kube.create(TASKS, labelled({"apiVersion": "tasklease.dev/v1alpha1", "kind": "Task",
                                        "metadata": {"name": name, "labels": labels or {}},
                                        "spec": {"queue": queue, **spec}}))


@pytest.fixture
def members(kube: Kube) -> Iterator[Callable[[str, int], tuple[list[Agent], list[QueueView]]]]:
    """`members(queue, n)`: n agents that joined `queue`, each seeing all of them."""
    made: list[Agent] = []

    def join(queue: str, n: int) -> tuple[list[Agent], list[QueueView]]:
        agents = [Agent(kube, identity=Identity(pod=f"{queue}-{i}", instance="x")) for i in range(n)]
        made.extend(agents)
        views = [a.join(queue) for a in agents]
        for view in views:
            for agent in agents:
                assert view.wait_for_member(agent.identity.holder, 10)
        return agents, views
    yield join
    for agent in made:
        agent.close()


def _named(holders: frozenset[str], wanted: Callable[[frozenset[str]], bool], prefix: str) -> str:
    """A task name whose shard's viewers among `holders` are `wanted`."""
    shards = viewers(holders)
    return next(n for n in (f"{prefix}-{i}" for i in range(10_000)) if wanted(shards[shard_of(n)]))


def test_each_agent_watches_the_tasks_of_its_shards_and_every_task_is_done_once(
        kube: Kube, members: Callable[[str, int], tuple[list[Agent], list[QueueView]]]) -> None:
    agents, views = members("sh", 4)
    holders = frozenset(a.identity.holder for a in agents)
    names = [f"t-{i:02d}" for i in range(40)]
    for name in names:
        _create(kube, name, "sh")
    _create(kube, "odd", "sh", labels={LABEL_SHARD: "99"})  # no shard: every agent watches it
    shards = viewers(holders)
    for agent, view in zip(agents, views, strict=True):
        mine = {n for n in names if agent.identity.holder in shards[shard_of(n)]} | {"odd"}
        wait_for(lambda: {n for n in [*names, "odd"] if view.task_watch.has(n)} == mine,  # noqa: B023
                 message=f"{agent.identity.holder} to watch its shards' tasks")
        assert view.partial and len(view.task_watch.viewed) in range(30, 36)  # about 2 x 64 / 4

    done: list[int] = []
    workers = [threading.Thread(target=lambda a=a: done.append(a.work("sh", lambda task: "ok", idle_timeout=3)))
               for a in agents]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert sum(done) == len(names) + 1
    for name in [*names, "odd"]:
        rec = record.decode(kube.get(LEASES, name))
        assert (rec.outcome, rec.epoch) == ("Succeeded", 1)


def test_an_idle_agent_claims_a_task_that_only_busy_peers_watch(
        kube: Kube, members: Callable[[str, int], tuple[list[Agent], list[QueueView]]]) -> None:
    """Its viewers hold long work and claim nothing: the agent that is idle reads the queue."""
    agents, views = members("bz", 3)
    holders = frozenset(a.identity.holder for a in agents)
    busy = frozenset(a.identity.holder for a in agents[:2])
    for i in range(2):
        _create(kube, f"long-{i}", "bz", priority=5)  # another band: every agent watches these
    held = [agent.claim("bz", timeout=30) for agent in agents[:2]]
    assert {t.name for t in held} == {"long-0", "long-1"}
    name = _named(holders, lambda v: v == busy, "theirs")
    _create(kube, name, "bz")
    task = agents[2].claim("bz", timeout=30)
    assert task.name == name and not views[2].task_watch.has(name)
    task.complete("ok")


def test_a_task_that_only_members_making_no_claim_watch_is_claimed_by_one_that_waits(
        kube: Kube, members: Callable[[str, int], tuple[list[Agent], list[QueueView]]]) -> None:
    """Its viewers joined and hold nothing, but make no claim (an SDK user between claims):
    the agent that waits reads the queue for it."""
    agents, views = members("nc", 3)
    holders = frozenset(a.identity.holder for a in agents)
    idle = frozenset(a.identity.holder for a in agents[:2])
    name = _named(holders, lambda v: v == idle, "unwatched")
    _create(kube, name, "nc")
    task = agents[2].claim("nc", timeout=30)
    assert task.name == name and not views[2].task_watch.has(name)
    task.complete("ok")


def test_a_lower_band_waits_while_a_shard_the_agent_does_not_watch_has_a_default_task(
        kube: Kube, members: Callable[[str, int], tuple[list[Agent], list[QueueView]]]) -> None:
    agents, views = members("st", 3)
    me = agents[2].identity.holder
    name = _named(frozenset(a.identity.holder for a in agents), lambda v: me not in v, "default")
    _create(kube, "low", "st", priority=-5)
    _create(kube, name, "st")
    wait_for(lambda: views[2].task_watch.has("low"), message="the low task in every agent's watch")
    task = agents[2].claim("st", timeout=30)
    assert task.name == name and not views[2].task_watch.has(name)
    task.complete("ok")
    assert agents[2].claim("st", timeout=30).name == "low"

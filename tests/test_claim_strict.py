"""The one-shot claim (`tasklease claim`) is strict priority across the whole queue, not within a page."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest

from conftest import Cluster, make_task
from tasklease.agent import Agent, ClaimedTask, Identity
from tasklease.agent.discovery import task_selector
from tasklease.agent.producer import Producer
from tasklease.agent.ranked import best_first
from tasklease.api import errors, models
from tasklease.api.timestamps import format_time, now_utc
from tasklease.kube import LEASES, TASKS, Kube
from tasklease.protocol import record
from tasklease.protocol.labels import LABEL_RANK, rank


def _agent(kube: Kube) -> Agent:
    return Agent(kube, identity=Identity(pod="shell", instance="1"))


def test_the_one_high_priority_task_beyond_the_first_page_is_claimed_first(kube: Kube) -> None:
    producer = Producer(kube)
    for i in range(40):
        producer.submit(f"a-low-{i:02d}", models.TaskSpec(queue="strict"))
    producer.submit("z-high", models.TaskSpec(queue="strict", priority=1000))  # newest, and last by name
    assert kube.get(TASKS, "z-high")["metadata"]["labels"][LABEL_RANK] == rank(1000)
    agent = _agent(kube)
    assert agent.settings.cli_page < 41  # the case the issue measured: more tasks than one page
    task = agent.claim_once("strict")
    assert task.name == "z-high"
    task.complete("ok")
    assert agent.claim_once("strict").name.startswith("a-low-")  # then the band below
    agent.close()


def test_a_task_created_without_the_rank_label_still_goes_first_by_its_priority(kube: Kube) -> None:
    producer = Producer(kube)
    for i in range(25):
        producer.submit(f"a-{i:02d}", models.TaskSpec(queue="loose", priority=5))
    kube.create(TASKS, {"apiVersion": "tasklease.dev/v1alpha1", "kind": "Task", "metadata": {"name": "by-hand"},
                        "spec": {"queue": "loose", "priority": 7}})  # as kubectl apply would: no label
    assert LABEL_RANK not in (kube.get(TASKS, "by-hand")["metadata"].get("labels") or {})
    agent = _agent(kube)
    first = agent.claim_once("loose")
    assert first.name == "by-hand"
    first.complete("ok")
    assert agent.claim_once("loose").name.startswith("a-")
    agent.close()


def test_a_band_with_nothing_claimable_yet_gives_way_to_the_next_one(kube: Kube) -> None:
    producer = Producer(kube)
    later = now_utc() + timedelta(hours=1)
    producer.submit("waits", models.TaskSpec.model_validate(
        {"queue": "bands", "priority": 9, "notBefore": format_time(later)}))
    producer.submit("middle", models.TaskSpec(queue="bands", priority=3))
    producer.submit("bottom", models.TaskSpec(queue="bands", priority=-1000))
    agent = _agent(kube)
    names = []
    for _ in range(2):
        task = agent.claim_once("bands")
        names.append(task.name)
        task.complete("ok")
    assert names == ["middle", "bottom"]
    try:
        agent.claim_once("bands")
        raise AssertionError("a task not yet due was claimed")
    except errors.NothingToClaim:
        pass
    agent.close()


def test_a_wrong_rank_label_changes_no_rule_of_the_claim(kube: Kube) -> None:
    """A producer is untrusted: a label saying the top band only moves where the claim looks
    first; a cancelled task labelled so is still not claimed, and the rest still is."""
    producer = Producer(kube)
    producer.submit("honest", models.TaskSpec(queue="lies", priority=1))
    lying = {"apiVersion": f"{models.GROUP}/{models.VERSION}", "kind": models.KIND,
             "metadata": {"name": "liar", "labels": {LABEL_RANK: rank(1000)}},
             "spec": {"queue": "lies", "priority": -1000, "cancel": True}}
    kube.create(TASKS, lying)
    agent = _agent(kube)
    assert agent.claim_once("lies").name == "honest"
    agent.close()


def test_every_claim_of_a_mixed_queue_takes_the_highest_priority_left(kube: Kube) -> None:
    """Bands spread over many pages, in and out of the first one, some tasks without the label:
    claim after claim, each takes a task of the highest priority left (tasks outside the first
    page's band fill more than a page at first, and less than one at the end)."""
    producer = Producer(kube)
    priorities = {f"t-{i:02d}": (-5, 0, 3, 0, -5)[i % 5] for i in range(45)}
    priorities["t-44"] = 9  # the only one of the top band, on the last page
    for name, priority in priorities.items():
        producer.submit(name, models.TaskSpec(queue="mixed", priority=priority))
    for name, priority in (("h-high", 7), ("h-low", -7), ("h-zero", 0)):  # as kubectl apply would: no label
        make_task(kube, name, queue="mixed", priority=priority)
        priorities[name] = priority
    agent = _agent(kube)
    assert agent.settings.cli_page < len(priorities) // 2
    claimed = []
    for _ in priorities:
        task = agent.claim_once("mixed")
        claimed.append(task.name)
        task.complete("ok")
    assert claimed[:2] == ["t-44", "h-high"]
    assert claimed[-1] == "h-low"
    got = [priorities[name] for name in claimed]
    assert got == sorted(priorities.values(), reverse=True), got
    with pytest.raises(errors.NothingToClaim):  # none was claimed twice
        agent.claim_once("mixed")
    agent.close()


def test_a_lease_rewritten_but_left_free_between_the_read_and_the_claim_is_still_claimed(
        kube: Kube, monkeypatch: pytest.MonkeyPatch) -> None:
    """The claim's conditional write loses to a write that is not a claim (the operator
    correcting a failed attempt's backoff end): the one-shot claim reads the Lease again and
    claims it, instead of answering "nothing claimable"."""
    Producer(kube).submit("moved", models.TaskSpec.model_validate(
        {"queue": "moved", "maxAttempts": 3, "backoff": {"initialSeconds": 0, "maxSeconds": 0}}))
    agent = _agent(kube)
    agent.claim_once("moved").fail("first attempt")
    real_patch = kube.merge_patch
    moved: list[str] = []

    def patch_after_a_rewrite(res, name, patch, **kw):  # type: ignore[no-untyped-def]
        if res == LEASES and not moved:  # the claim's write: another writer goes first
            moved.append(real_patch(LEASES, name, {"metadata": {"annotations": {"example.com/moved": "1"}}},
                                    namespace=kw.get("namespace"))["metadata"]["resourceVersion"])
        return real_patch(res, name, patch, **kw)
    monkeypatch.setattr(kube, "merge_patch", patch_after_a_rewrite)
    task = agent.claim_once("moved")
    assert moved, "the claim wrote the Lease without a patch"
    assert (task.name, task.epoch) == ("moved", 2)
    agent.close()


def test_a_first_page_of_tasks_outside_the_default_band_hides_no_default_task(kube: Kube) -> None:
    """Every task outside the default priority's band fits one page and fills the first page:
    the default band's tasks, all after that page, are still read (here the others are not yet
    due, so one of the default band is the one to claim)."""
    producer = Producer(kube)
    agent = _agent(kube)
    later = format_time(now_utc() + timedelta(hours=1))
    for i in range(agent.settings.cli_page):
        producer.submit(f"a-later-{i:02d}", models.TaskSpec.model_validate(
            {"queue": "hidden", "priority": 5, "notBefore": later}))
    for i in range(3):
        producer.submit(f"z-now-{i}", models.TaskSpec(queue="hidden"))
    assert agent.claim_once("hidden").name.startswith("z-now-")
    agent.close()


@pytest.mark.parametrize("claim", [
    pytest.param(lambda agent: agent.claim_once("just"), id="one-shot"),  # tasklease claim
    pytest.param(lambda agent: agent.claim("just", timeout=0), id="watching"),  # tasklease run, no --wait
])
def test_a_new_process_claims_a_task_whose_backoff_ended_a_moment_ago(
        cluster: Cluster, kube: Kube, claim: Callable[[Agent], ClaimedTask]) -> None:
    """A new process's first look is made before any answer has dated the server's clock: a
    backoff that ended a moment ago is within what it cannot yet tell, so it looks once more
    (or waits for it) instead of answering "nothing claimable" (the claim's rule judges by the
    server's clock)."""
    Producer(kube).submit("just", models.TaskSpec.model_validate(
        {"queue": "just", "maxAttempts": 3, "backoff": {"initialSeconds": 0, "maxSeconds": 0}}))
    first = _agent(kube)
    first.claim_once("just").fail("first attempt")
    first.close()
    ended = format_time(now_utc() - timedelta(milliseconds=50))
    kube.merge_patch(LEASES, "just", {"metadata": {"annotations": {record.ANN_NOT_BEFORE: ended}}})
    fresh = Agent(cluster.kube(kube.namespace), identity=Identity(pod="shell", instance="2"))
    task = claim(fresh)
    assert (task.name, task.epoch) == ("just", 2)
    fresh.close()


def test_a_look_served_by_the_watch_cache_as_it_is_is_strict_and_reads_pages(kube: Kube) -> None:
    """A watching agent's first look (`fresh=False`) does not wait for the watch cache to reach
    etcd (a consistent read): it asks for any version the cache holds. The API server still
    answers it a page at a time, as `resourceVersion=0` would not (every selected Task in one
    answer), and the order is still strict."""
    producer = Producer(kube)
    for i in range(30):
        producer.submit(f"a-{i:02d}", models.TaskSpec(queue="cached"))
    producer.submit("z-top", models.TaskSpec(queue="cached", priority=50))
    real_request = kube.request
    answers: list[tuple[dict[str, str | int], int]] = []

    def recorded(method: str, path: str, **kw: Any) -> Any:
        got = real_request(method, path, **kw)
        if path.endswith("/tasks"):
            answers.append((dict(kw.get("query") or {}), len(got.get("items", []))))
        return got
    kube.request = recorded  # type: ignore[method-assign]
    with ThreadPoolExecutor(1) as beside:
        found = best_first(kube, namespace=kube.namespace, field_selector=task_selector("cached"), page=5,
                           beside=beside, fresh=False)
        names = [task["metadata"]["name"] for task in found]  # on into the default band's pages
    assert names[0] == "z-top" and sorted(names[1:]) == [f"a-{i:02d}" for i in range(30)], names
    assert len(answers) > 3, answers  # the band's pages were read too
    assert all(count <= 5 for _, count in answers), answers
    # None is a consistent read: a page goes on by its continue token, from its first's snapshot.
    assert all(query.get("resourceVersion") or query.get("continue") for query, _ in answers), answers

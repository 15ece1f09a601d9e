"""Shards: which agents watch a task (`division.viewers`), the label producers give it, and the
watches that follow an agent's shards (`taskwatch.TaskWatches`). No API server."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasklease.agent.division import VIEWERS, viewers
from tasklease.agent.taskwatch import TaskWatches
from tasklease.api import errors
from tasklease.kube import JSON
from tasklease.protocol.labels import (DEFAULT_RANK, LABEL_RANK, LABEL_SHARD, SHARDS, labelled, relabelled, shard_label,
                                       shard_of)

pytestmark = pytest.mark.unit
_PEERS = st.frozensets(st.text("abcdefgh/", min_size=1, max_size=6), min_size=1, max_size=24)


@settings(max_examples=60, deadline=None)
@given(_PEERS)
def test_every_shard_has_its_viewers_and_every_peer_views_about_its_part(peers: frozenset[str]) -> None:
    found = viewers(peers)
    assert len(found) == SHARDS
    assert all(len(v) == min(VIEWERS, len(peers)) and v <= peers for v in found)
    load = Counter(p for v in found for p in v)
    assert max(load.values()) <= (SHARDS if len(peers) <= VIEWERS else math.ceil(VIEWERS * SHARDS / len(peers)) + 2)
    assert found == viewers(frozenset(sorted(peers, reverse=True)))  # every agent computes the same


@pytest.mark.parametrize("count", [4, 8, 16])
def test_a_peer_that_comes_or_goes_moves_its_own_shards_and_a_few_more(count: int) -> None:
    """Each shard that gains a viewer is listed again by it: a change of peers should move
    little more than the shards of the peer that came or went."""
    peers = frozenset(f"agent-{i}/x" for i in range(count))
    before = viewers(peers)
    for changed in (peers | {"new/x"}, peers - {"agent-0/x"}):
        after = viewers(changed)
        moved = sum(len(a - b) for a, b in zip(after, before, strict=True))
        own = sum(1 for v in (after if len(changed) > len(peers) else before) if (peers ^ changed) & v)
        assert own <= moved <= 2 * own


def test_a_shard_label_is_read_only_when_it_names_a_shard() -> None:
    assert shard_label({LABEL_SHARD: "7"}) == 7
    for bad in ("", "64", "-1", "07", "x", " 3"):
        assert shard_label({LABEL_SHARD: bad}) is None
    assert shard_label(None) is None and shard_label({}) is None


def test_producers_label_a_task_with_its_shard_and_rank_and_keep_what_it_has() -> None:
    body = labelled({"metadata": {"name": "t-1"}, "spec": {"queue": "q"}})
    assert body["metadata"]["labels"] == {LABEL_SHARD: str(shard_of("t-1")), LABEL_RANK: str(DEFAULT_RANK)}
    unnamed = labelled({"metadata": {"generateName": "q-"}, "spec": {"queue": "q", "priority": 5}})
    assert shard_label(unnamed["metadata"]["labels"]) is not None
    kept = labelled({"metadata": {"name": "t", "labels": {LABEL_SHARD: "3", LABEL_RANK: "9"}}, "spec": {}})
    assert kept["metadata"]["labels"] == {LABEL_SHARD: "3", LABEL_RANK: "9"}
    assert {shard_of(f"t-{i}") for i in range(2000)} == set(range(SHARDS))


class _NoKube:
    """Watches that are never started: the tests deliver their events by hand."""

    namespace = "ns"

    def __init__(self) -> None:
        self.watched: list[tuple[str, str]] = []  # (label selector, resource version) of each watch asked for

    def list_pages(self, *args: Any, **kwargs: Any) -> Iterator[JSON]:
        yield {"metadata": {"resourceVersion": "1"}, "items": []}

    def list(self, *args: Any, **kwargs: Any) -> JSON:
        raise errors.Forbidden("no API server here")  # a watch that lists stops at once

    def watch(self, *args: Any, label_selector: str, resource_version: str, **kwargs: Any) -> Iterator[JSON]:
        self.watched.append((label_selector, resource_version))
        raise errors.Forbidden("no API server here")


def _task(name: str, shard: int | None) -> JSON:
    labels = {LABEL_RANK: str(DEFAULT_RANK)} | ({} if shard is None else {LABEL_SHARD: str(shard)})
    return {"metadata": {"name": name, "namespace": "ns", "labels": labels}}


def _watches() -> tuple[TaskWatches, list[str], list[str]]:
    told: list[str] = []
    dropped: list[str] = []
    watches = TaskWatches(_NoKube(), namespace="ns", queue="q",  # type: ignore[arg-type]
                          listener=lambda kind, obj: told.append(f"{kind} {obj['metadata']['name']}"),
                          drop=dropped.extend, field_selector="spec.queue=q", watch_field_selector="spec.queue=q",
                          batch_s=0.0)
    return watches, told, dropped


def _key(watches: TaskWatches, shard: int) -> int:
    return watches._by_shard[shard]


def test_the_tasks_of_a_shard_given_up_leave_at_once_and_its_late_events_are_ignored() -> None:
    watches, told, dropped = _watches()
    watches._view(frozenset({1, 2}))  # as `start` does, without the threads
    first = _key(watches, 1)
    watches._on(first, "ADDED", _task("a", 1))
    watches._on(first, "ADDED", _task("b", 2))
    assert watches.shard("a") == 1 and watches.has("b")
    watches.view({2, 3})  # shard 1 given up, 3 gained (a watch of its own)
    assert dropped == ["a"] and not watches.has("a") and watches.has("b")
    assert _key(watches, 3) != first and _key(watches, 2) == first
    watches._on(first, "MODIFIED", _task("a", 1))  # the first watch still lists shard 1: not ours
    watches._on(first, "DELETED", _task("a", 1))
    assert told == ["ADDED a", "ADDED b"]
    watches._on(_key(watches, 3), "ADDED", _task("c", 3))
    assert watches.shard("c") == 3 and told[-1] == "ADDED c"


def test_a_task_that_moves_between_watches_is_neither_lost_nor_kept_twice() -> None:
    watches, told, _ = _watches()
    watches._view(frozenset({1, 2}))
    sharded = _key(watches, 1)
    watches._on(sharded, "ADDED", _task("a", 1))
    watches._on(-2, "ADDED", _task("a", None))  # its shard label removed: the loose watch tells it first
    watches._on(sharded, "DELETED", _task("a", 1))  # then the shard watch: it left that selection
    assert watches.has("a") and watches.shard("a") is None and told == ["ADDED a", "ADDED a"]
    watches._on(-2, "DELETED", _task("a", None))
    assert not watches.has("a") and told[-1] == "DELETED a"


def test_past_a_few_shard_watches_one_watch_lists_every_shard_viewed_again() -> None:
    watches, _, dropped = _watches()
    watches._view(frozenset({0}))
    watches._on(_key(watches, 0), "ADDED", _task("a", 0))
    for shard in range(1, 6):
        watches.view(set(range(shard + 1)))
    keys = {k for k in watches._watches if k >= 0}
    assert len(keys) <= 4 and dropped == []
    assert watches._told["a"] == _key(watches, 0)  # the watch that lists shard 0 now answers for it


def test_a_watch_whose_shards_are_mostly_others_now_is_replaced_and_its_tasks_kept() -> None:
    watches, told, dropped = _watches()
    watches._view(frozenset(range(8)))  # alone at first: many shards
    first = _key(watches, 0)
    watches._on(first, "ADDED", _task("a", 0))
    watches._on(first, "ADDED", _task("b", 5))
    watches.view({0, 1, 9})  # peers came: 3 of the 8 stay ours, and one more
    assert dropped == ["b"] and watches.has("a")
    assert first not in watches._watches and watches._told["a"] == _key(watches, 0) == _key(watches, 9)
    watches._on(first, "MODIFIED", _task("a", 0))  # the replaced watch's last events are ignored
    assert told == ["ADDED a", "ADDED b"]


def test_a_watch_that_told_everything_hands_its_shards_still_viewed_to_a_narrower_one_without_a_list() -> None:
    watches, told, dropped = _watches()
    watches._view(frozenset({0, 1, 2}))
    first = _key(watches, 0)
    watches._on(first, "ADDED", _task("a", 0))
    watches._on(first, "ADDED", _task("b", 2))
    watches._watches[first].delivered = "7"  # its list has ended: it told everything up to version 7
    watches.view({0, 1})  # a peer came: shard 2 is its now
    narrowed = _key(watches, 0)
    assert narrowed != first and _key(watches, 1) == narrowed and first not in watches._watches
    assert watches._listing[narrowed] == frozenset({0, 1})
    watches._watches[narrowed]._thread.join(5)
    assert watches._kube.watched == [(f"{LABEL_RANK}={DEFAULT_RANK},{LABEL_SHARD} in (0,1)", "7")]  # type: ignore[attr-defined]
    assert dropped == ["b"] and watches._told == {"a": narrowed}
    watches._on(first, "MODIFIED", _task("a", 0))  # the old watch's last events are ignored
    watches._on(narrowed, "MODIFIED", _task("a", 0))
    assert told == ["ADDED a", "ADDED b", "MODIFIED a"]


def test_a_watch_still_listing_keeps_shards_of_others_until_they_are_most_of_it() -> None:
    watches, _, dropped = _watches()
    watches._view(frozenset({0, 1, 2}))
    first = _key(watches, 0)
    watches.view({0, 1})  # no version to hand over from yet: two of three shards are still ours
    assert _key(watches, 0) == first and watches._listing[first] == frozenset({0, 1, 2})


def test_relabelled_names_only_the_labels_a_stored_task_lacks_or_has_wrong() -> None:
    def stored(labels: dict[str, str], priority: int = 0) -> JSON:
        return {"metadata": {"name": "t-1", "labels": labels}, "spec": {"queue": "q", "priority": priority}}
    assert relabelled(labelled(stored({}))) == {}  # as producers label it
    assert relabelled(stored({})) == {LABEL_SHARD: str(shard_of("t-1")), LABEL_RANK: str(DEFAULT_RANK)}
    assert relabelled(stored({LABEL_SHARD: "99", LABEL_RANK: str(DEFAULT_RANK)})) == {LABEL_SHARD: str(shard_of("t-1"))}
    assert relabelled(stored({LABEL_SHARD: "7", LABEL_RANK: str(DEFAULT_RANK)}, priority=3)) == {
        LABEL_RANK: str(DEFAULT_RANK + 3)}  # a valid shard stays, even if not the name's

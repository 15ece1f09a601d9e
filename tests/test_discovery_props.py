"""The candidate index and an agent's picture of a queue, as properties (Hypothesis): no
control plane, events fed to the view by hand, and time injected."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasklease.agent.candidates import CandidateIndex
from tasklease.agent.discovery import QueueView
from tasklease.agent.division import divide, owner
from tasklease.kube import JSON
from tasklease.protocol import LeaseRecord, TaskView, record
from tasklease.protocol.rules import blocker

pytestmark = pytest.mark.unit

NOW = datetime(2030, 1, 1, tzinfo=UTC)
names = st.sampled_from([f"t{i}" for i in range(12)])
ops = st.lists(st.tuples(st.sampled_from(["add", "discard", "best"]), names, st.sampled_from([0, 0, 5, 9]),
                         st.integers(0, 20), st.sampled_from([1, 3, 8])), max_size=80)


@settings(deadline=None)  # no timing in tests: a loaded machine is slow
@given(ops)
def test_the_index_answers_as_the_sorted_live_candidates_of_the_top_band(steps: list[tuple[str, str, int, int,
                                                                                          int]]) -> None:
    _answers_as_sorted(steps)


def _answers_as_sorted(steps: list[tuple[str, str, int, int, int]]) -> None:
    index, live = CandidateIndex(), {}
    for op, name, priority, second, window in steps:
        if op == "add":
            live[name] = (priority, f"2030-01-01T00:00:{second:02d}Z")
            index.add(name, *live[name])
        elif op == "discard":
            index.discard(name)
            live.pop(name, None)
        else:
            top = max((p for p, _ in live.values()), default=0)
            assert index.best(window) == [n for _, n in sorted((c, n) for n, (p, c) in live.items() if p == top)][
                :window]
        assert len(index) == len(live)


crowded = st.lists(st.tuples(st.sampled_from(["add", "add", "discard", "best"]),
                             st.sampled_from(["t0", "t1", "t2", "t3"]), st.sampled_from([0, 0, 0, 5]),
                             st.integers(0, 1), st.sampled_from([2, 8])), max_size=60)


@settings(deadline=None)  # no timing in tests: a loaded machine is slow
@given(crowded)
def test_the_index_answers_as_the_sorted_live_candidates_when_many_share_a_second(
        steps: list[tuple[str, str, int, int, int]]) -> None:
    """Many tasks created in the same second, moved between bands, dropped and added again:
    what a second's candidates leave behind (stale names, duplicates) never shows."""
    _answers_as_sorted(steps)


peer_sets = st.sets(st.sampled_from([f"pod-{i}/1" for i in range(6)]), min_size=1)


@settings(deadline=None)  # no timing in tests: a loaded machine is slow
@given(peer_sets, st.lists(names, unique=True, min_size=1))
def test_every_task_is_ours_for_exactly_one_peer_and_that_peer_is_its_owner(peers: set[str],
                                                                            tasks: list[str]) -> None:
    owners = {name: owner(peers, name) for name in tasks}
    mine = {peer: divide(peer, tasks, owners.__getitem__) for peer in peers}
    for name in tasks:
        claimed_by = [peer for peer, division in mine.items() if name in division.names[:division.ours]]
        assert claimed_by == [owners[name][1]]
    for division in mine.values():  # none ours: the others', all of them, for a thief
        assert division.ours == len(division.names) or sorted(division.names) == sorted(tasks)


def _task(name: str, priority: int, cancel: bool, attempt: int) -> JSON:
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "creationTimestamp":
                         f"2029-12-31T00:00:{int(name[1:]):02d}Z"},
            "spec": {"queue": "q", "priority": priority, "cancel": cancel},
            "status": {"attempt": attempt} if attempt else {}}


def _free_lease(name: str, epoch: int, backoff_s: int) -> JSON:
    return record.encode(LeaseRecord(name=name, namespace="ns", queue="q", owner_uid=f"uid-{name}", epoch=epoch,
                                     not_before=NOW + timedelta(seconds=backoff_s) if backoff_s else None,
                                     resource_version=str(epoch)))


tasks_and_leases = st.lists(st.tuples(names, st.sampled_from([0, 5]), st.booleans(), st.integers(0, 2),
                                      st.sampled_from([0, 0, 30])), max_size=15, unique_by=lambda e: e[0])


@settings(deadline=None)  # no timing in tests: a loaded machine is slow
@given(tasks_and_leases, st.integers(0, 60))
def test_a_lone_agent_is_offered_exactly_the_claimable_tasks_of_the_top_band(
        events: list[tuple[str, int, bool, int, int]], later_s: int) -> None:
    server = SimpleNamespace(now=lambda: NOW)  # no watch runs: only the server's time is read
    view = QueueView(server, namespace="ns", queue="q", clock=lambda: 0.0)  # type: ignore[arg-type]
    known: dict[str, tuple[TaskView, LeaseRecord | None]] = {}
    for name, priority, cancel, attempt, backoff_s in events:
        task = _task(name, priority, cancel and attempt > 0, attempt)
        view._on_task("ADDED", task)
        rec = None
        if attempt:  # claimed before: its Lease is free again (after a backoff, maybe)
            lease = _free_lease(name, attempt, backoff_s)
            view._on_lease("ADDED", lease)
            rec = record.decode(lease)
        known[name] = (TaskView.of(task), rec)
    now = NOW + timedelta(seconds=later_s)
    claimable = {n for n, (t, r) in known.items() if blocker(t, r, now) is None}
    top = max((known[n][0].spec.priority for n in claimable), default=None)
    candidates, division = view.choose("me/1", now, window=32)
    offered = [task.name for task, _ in candidates]
    assert set(offered) == {n for n in claimable if known[n][0].spec.priority == top}
    assert division.ours == len(offered)  # alone: all of them are ours

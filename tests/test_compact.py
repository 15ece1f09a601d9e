"""An open task kept compact reads back as the same view, whatever the Task (Hypothesis)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasklease.agent.compact import compact, expand, same_task
from tasklease.protocol import TaskView

pytestmark = pytest.mark.unit

times = st.datetimes(min_value=datetime(1970, 1, 1), max_value=datetime(2200, 1, 1), timezones=st.just(UTC))
uids = st.one_of(st.uuids().map(str), st.uuids().map(lambda u: str(u).upper()), st.uuids().map(lambda u: u.hex),
                 st.text(min_size=1, max_size=80))
created = st.one_of(times.map(lambda t: t.strftime("%Y-%m-%dT%H:%M:%SZ")),  # as the API server writes it
                    times.map(lambda t: t.isoformat()), st.just(""), st.text(max_size=40))
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                       max_size=3), max_leaves=8)
backoffs = st.fixed_dictionaries({}, optional={"policy": st.sampled_from(["Exponential", "Fixed"]),
                                               "initialSeconds": st.integers(0, 5), "maxSeconds": st.integers(5, 300),
                                               "jitter": st.booleans()})
specs = st.fixed_dictionaries({"queue": st.sampled_from(["q", "other"])}, optional={
    "payload": st.dictionaries(st.text(max_size=6), json_values, max_size=3),
    "priority": st.sampled_from([0, 0, -1000, 7, 1000]), "maxAttempts": st.sampled_from([3, 1, 100]),
    "leaseDurationSeconds": st.sampled_from([30, 5, 3600]), "backoff": backoffs, "cancel": st.booleans(),
    "deadline": st.one_of(st.none(), times.map(lambda t: t.isoformat())),
    "notBefore": st.one_of(st.none(), times.map(lambda t: t.strftime("%Y-%m-%dT%H:%M:%SZ"))),
    "attemptTimeoutSeconds": st.one_of(st.none(), st.integers(1, 100)),
    "ttlSecondsAfterFinished": st.one_of(st.none(), st.integers(0, 100))})
statuses = st.fixed_dictionaries({}, optional={"attempt": st.integers(0, 100),
                                               "phase": st.sampled_from(["", "Pending", "Running"])})


@settings(deadline=None)  # no timing in tests: a loaded machine is slow
@given(uids, created, specs, statuses, st.sampled_from(["", "q"]))
def test_a_task_kept_compact_reads_back_as_the_same_view(uid: str, at: str, spec: dict[str, Any],
                                                         status: dict[str, Any], queue: str) -> None:
    task = {"metadata": {"name": "t", "namespace": "ns", "uid": uid, "creationTimestamp": at,
                         "resourceVersion": "7", "labels": {"tasklease.dev/rank": "1000"}},
            "spec": spec, "status": status}
    assert expand(compact(task, queue=queue), name="t", namespace="ns", queue=queue) == TaskView.of(task)


@settings(deadline=None)
@given(uids, uids, specs, specs)
def test_the_same_task_is_told_by_its_uid_alone(one: str, other: str, spec: dict[str, Any],
                                              changed: dict[str, Any]) -> None:
    def task(uid: str, spec: dict[str, Any]) -> dict[str, Any]:
        return {"metadata": {"uid": uid, "creationTimestamp": "2026-01-01T00:00:00Z"}, "spec": spec}
    assert same_task(compact(task(one, spec)), compact(task(one, changed)))
    assert same_task(compact(task(one, spec)), compact(task(other, spec))) == (one == other)


@pytest.mark.parametrize("at", ["2026-01-01T00:00:00Z", "1970-01-01T00:00:00Z", "2026-01-01T00:00:00.5Z",
                                "2026-01-01T00:00:00+01:00", "2026-02-30T00:00:00Z", "not a time", ""])
def test_a_creation_time_reads_back_as_written_packed_or_not(at: str) -> None:
    task = {"metadata": {"uid": "u", "creationTimestamp": at}, "spec": {"queue": "q"}}
    assert expand(compact(task), name="t", namespace="ns").created == at


def test_the_common_task_keeps_its_uid_time_and_payload_and_little_else() -> None:
    """Defaults as the API server fills them in, the watched queue, no attempt yet: none is kept
    (a Pending status in one byte)."""
    task = {"metadata": {"uid": str(uuid.uuid4()), "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"queue": "q", "payload": {"i": 12345}, "priority": 0, "maxAttempts": 3,
                     "leaseDurationSeconds": 30, "cancel": False,
                     "backoff": {"policy": "Exponential", "initialSeconds": 5, "maxSeconds": 300, "jitter": True}}}
    assert compact(task, queue="q") == compact(task, queue="q")[:23] + b'{"payload":{"i":12345}}'
    assert len(compact({**task, "spec": {"queue": "q"}}, queue="q")) == 1 + 16 + 1 + 5
    waiting = {**task, "status": {"phase": "Pending", "reason": "", "holder": "", "attempt": 0, "result": "",
                                  "lastError": "", "observedGeneration": 0}}  # the CRD's default status
    assert len(compact(waiting, queue="q")) == len(compact(task, queue="q")) + 1

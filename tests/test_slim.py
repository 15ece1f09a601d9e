"""What the operator keeps per Task and per Lease: all a decision reads comes back, in a fraction of the size."""

from __future__ import annotations

import pytest

import json
from datetime import UTC, datetime

from hypothesis import given, settings
from hypothesis import strategies as st

from tasklease.api import models
from tasklease.operator import projection
from tasklease.operator.slim import SlimTask, Warm, slim, slim_lease
from tasklease.protocol import LeaseRecord, record

pytestmark = pytest.mark.unit  # pure logic: `make unit` runs it, on every Python

AT = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def _task(payload: object) -> dict[str, object]:
    return {"apiVersion": "tasklease.dev/v1alpha1", "kind": "Task",
            "metadata": {"name": "t-1", "namespace": "ns", "uid": "u-1", "resourceVersion": "7", "generation": 1,
                         "creationTimestamp": "2026-01-02T03:04:05Z", "managedFields": [{"manager": "x"}],
                         "annotations": {"a": "b"}},
            "spec": {**models.TaskSpec(queue="q").model_dump(mode="json", by_alias=True), "payload": payload},
            "status": {"phase": "Pending", "reason": "Waiting", "attempt": 0, "observedGeneration": 1}}


def test_a_task_comes_back_with_what_decisions_read_and_without_its_payload() -> None:
    task = _task({"image": "x" * 2000})
    kept = slim(task)
    back = kept.json()
    assert back["metadata"] == {k: v for k, v in task["metadata"].items()  # type: ignore[attr-defined]
                                if k not in ("managedFields", "annotations")}
    assert back["status"] == task["status"]
    assert "payload" not in back["spec"] and back["spec"]["queue"] == "q"
    assert (kept.queue, kept.created) == ("q", "2026-01-02T03:04:05Z")
    kept.cool()
    assert kept.warm is None and kept.json() == back
    assert len(kept.packed) < len(json.dumps(back)) / 2


def _too_deep(**level: object) -> dict[str, object]:
    """A payload nested one level deeper than a Task may hold, each level holding `level` too."""
    deep: dict[str, object] = {}
    inner = deep
    for _ in range(models.MAX_PAYLOAD_DEPTH + 1):
        inner["a"] = dict(level)
        inner = inner["a"]  # type: ignore[assignment]
    return deep


def test_a_payload_nested_too_deeply_is_kept_so_the_operator_can_fail_the_task() -> None:
    assert models.payload_depth(slim(_task(_too_deep())).json()["spec"]["payload"]) > models.MAX_PAYLOAD_DEPTH


def test_a_lease_decodes_to_the_same_record_with_its_uid() -> None:
    rec = LeaseRecord(name="t-1", namespace="ns", queue="q", owner_uid="u-1", holder="pod-1/abc", epoch=2,
                      acquired_at=AT, renewed_at=AT, resource_version="9", error="boom",
                      history=(models.Attempt(attempt=1, holder="pod-0/def", claimed_at=AT, ended_at=AT,
                                              outcome="Expired"),))
    raw = record.encode(rec)
    raw["metadata"].update(uid="lease-uid", managedFields=[{"manager": "x"}])
    read = record.decode(raw)
    kept = slim_lease(read)
    assert kept.record() == read
    kept.cool()
    assert kept.warm is None and kept.packed
    assert kept.record() == read
    assert kept.record().raw["metadata"]["uid"] == "lease-uid"
    assert "managedFields" not in kept.record().raw["metadata"]
    assert (kept.held_by_pod, kept.resource_version) == ("pod-1", "9")
    assert slim_lease(record.decode(record.encode(LeaseRecord(name="t", namespace="n", queue="q",
                                                                owner_uid="u")))).held_by_pod == ""


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                     | st.text(), lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner,
                                                                                                max_size=4),
                     max_leaves=20)


@settings(deadline=None)  # no timing in tests: a loaded machine is slow
@given(st.dictionaries(st.text(), _json, max_size=6))
def test_whatever_a_status_holds_comes_back_as_it_was(status: dict[str, object]) -> None:
    task = {**_task({"i": 1}), "status": status}
    kept = slim(task)
    kept.cool()
    assert kept.json()["status"] == status


def test_a_status_larger_than_the_deflate_window_comes_back_as_it_was() -> None:
    """The window is sized for objects of a few KiB; a larger one (a long history of
    attempts, say) still comes back whole, only deflated less well."""
    status = {"message": "x" * 40_000, "history": [{"attempt": i, "holder": f"pod-{i}/1"} for i in range(2000)]}
    kept = slim({**_task({"i": 1}), "status": status})
    kept.cool()
    assert kept.json()["status"] == status


def test_a_finished_task_deflates_to_a_fraction_of_its_json() -> None:
    """A task held once and closed Succeeded, as the projection writes it: what most Tasks
    kept at depth look like once a queue has drained."""
    task = _task({"i": 1})
    task["metadata"]["uid"] = "3f2c9a0e-5b7d-4c1e-9a8f-0d6b2e4c7a91"  # type: ignore[index]
    closed = LeaseRecord(name="t-1", namespace="ns", queue="q", owner_uid="3f2c9a0e-5b7d-4c1e-9a8f-0d6b2e4c7a91",
                         epoch=1, acquired_at=AT, renewed_at=AT, outcome="Succeeded", reason="Completed",
                         result="ok", history=(models.Attempt(attempt=1, holder="pod-3/81422", claimed_at=AT,
                                                              ended_at=AT, outcome="Succeeded"),))
    status = projection.project(task, closed, old=models.TaskStatus(), now=AT)
    task["status"] = status.model_dump(mode="json", by_alias=True, exclude_none=True)
    kept = slim(task)
    kept.cool()
    assert kept.json()["status"] == task["status"]
    assert len(kept.packed) < len(json.dumps(kept.json(), separators=(",", ":"))) / 5


def test_the_store_keeps_its_last_objects_warm_and_says_which_must_cool() -> None:
    warm = Warm[SlimTask](2)
    a, b, c, a2 = (slim(_task({"i": i})) for i in range(4))
    assert warm.add("a", a) is None and warm.add("b", b) is None
    assert warm.add("a", a2) is None  # a replaced: only what the store holds is ever cooled
    assert warm.add("c", c) is b  # three held: the coldest must cool
    warm.discard("a")  # deleted: never cooled
    assert warm.add("d", slim(_task({"i": 5}))) is None
    assert warm.add("e", slim(_task({"i": 6}))) is c
    c.cool()
    assert c.warm is None and c.json()["spec"]["queue"] == "q"


def test_a_task_whose_payload_is_kept_is_never_kept_as_read() -> None:
    """A payload nested too deeply may be huge: the store's warm Tasks must not hold it."""
    kept = slim(_task(_too_deep(pad="x" * 1000)))
    assert kept.warm is None and kept.packed
    assert slim(_task({"i": 1})).warm is not None

"""What the operator keeps per Task and per Lease: all a decision reads comes back, in a fraction of the size."""

from __future__ import annotations

import pytest

import json
from datetime import UTC, datetime

from tasklease.api import models
from tasklease.operator.slim import slim, slim_lease
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
    assert len(kept.packed) < len(json.dumps(back)) / 2


def test_a_payload_nested_too_deeply_is_kept_so_the_operator_can_fail_the_task() -> None:
    deep: dict[str, object] = {}
    inner = deep
    for _ in range(models.MAX_PAYLOAD_DEPTH + 1):
        inner["a"] = {}
        inner = inner["a"]  # type: ignore[assignment]
    assert models.payload_depth(slim(_task(deep)).json()["spec"]["payload"]) > models.MAX_PAYLOAD_DEPTH


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
    assert kept.record().raw["metadata"]["uid"] == "lease-uid"
    assert (kept.held_by_pod, kept.resource_version) == ("pod-1", "9")
    assert slim_lease(record.decode(record.encode(LeaseRecord(name="t", namespace="n", queue="q",
                                                                owner_uid="u")))).held_by_pod == ""

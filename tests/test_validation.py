"""Invalid tasks are refused by the API server itself, with a message that says what is wrong."""

from __future__ import annotations

from typing import Any

import pytest

from conftest import make_task
from tasklease.api import errors
from tasklease.kube import TASKS, Kube

CASES: list[tuple[str, dict[str, Any], str]] = [
    ("no-queue", {"queue": None}, "spec.queue: Required value"),
    ("queue-not-dns", {"queue": "Bad_Queue"}, "spec.queue: Invalid value"),
    ("queue-too-long", {"queue": "q" * 64}, "may not be more than 63"),
    ("priority-too-high", {"priority": 5000},
     "spec.priority: Invalid value: 5000: spec.priority in body should be less than or equal to 1000"),
    ("no-attempts", {"maxAttempts": 0}, "spec.maxAttempts"),
    ("lease-too-short", {"leaseDurationSeconds": 1}, "spec.leaseDurationSeconds"),
    ("backoff-inverted", {"backoff": {"initialSeconds": 60, "maxSeconds": 10}},
     "backoff.maxSeconds must be at least backoff.initialSeconds"),
    ("backoff-policy", {"backoff": {"policy": "Linear"}}, 'supported values: "Exponential", "Fixed"'),
    ("unknown-field", {"retries": 3}, 'unknown field "spec.retries"'),
    ("unknown-nested", {"backoff": {"factor": 3}}, 'unknown field "spec.backoff.factor"'),
    ("attempt-timeout-zero", {"attemptTimeoutSeconds": 0}, "spec.attemptTimeoutSeconds"),
    ("payload-not-object", {"payload": "hello"}, "spec.payload: Invalid value"),
    ("deadline-not-time", {"deadline": "tomorrow"}, "spec.deadline"),
    ("deadline-year-0", {"deadline": "0000-06-01T00:00:00Z"}, "spec.deadline: Invalid value"),
    ("not-before-year-10000-in-utc", {"notBefore": "9999-12-31T23:00:00-05:00"},
     "spec.notBefore: Invalid value: \"9999-12-31T23:00:00-05:00\": must be a time in the years 1 to 9999"),
    ("cancel-not-bool", {"cancel": "yes"}, "spec.cancel: Invalid value"),
]


@pytest.mark.parametrize(("name", "spec", "message"), CASES, ids=[c[0] for c in CASES])
def test_invalid_task_is_refused_with_a_clear_message(kube: Kube, name: str, spec: dict[str, Any],
                                                      message: str) -> None:
    body = {"apiVersion": "tasklease.dev/v1alpha1", "kind": "Task", "metadata": {"name": name},
            "spec": {"queue": "q", **spec}}
    body["spec"] = {k: v for k, v in body["spec"].items() if v is not None}
    with pytest.raises(errors.Invalid) as refused:
        kube.create(TASKS, body)
    assert message in str(refused.value)
    assert kube.get_or_none(TASKS, name) is None


def test_a_task_without_spec_is_refused(kube: Kube) -> None:
    with pytest.raises(errors.Invalid, match="spec: Required value"):
        kube.create(TASKS, {"apiVersion": "tasklease.dev/v1alpha1", "kind": "Task", "metadata": {"name": "bare"}})


@pytest.mark.parametrize(("change", "message"), [
    ({"queue": "other"}, "spec.queue is immutable"),
    ({"payload": {"x": 2}}, "spec.payload is immutable"),
])
def test_immutable_fields_cannot_change(kube: Kube, change: dict[str, Any], message: str) -> None:
    make_task(kube, "fixed", payload={"x": 1})
    with pytest.raises(errors.Invalid, match=message):
        kube.merge_patch(TASKS, "fixed", {"spec": change})


def test_cancel_cannot_be_undone(kube: Kube) -> None:
    make_task(kube, "cancelled", cancel=True)
    with pytest.raises(errors.Invalid, match="spec.cancel cannot be undone once set"):
        kube.merge_patch(TASKS, "cancelled", {"spec": {"cancel": False}})


def test_payload_keeps_unknown_fields(kube: Kube) -> None:
    created = make_task(kube, "free-form", payload={"anything": {"nested": [1, 2]}, "goes": True})
    assert created["spec"]["payload"] == {"anything": {"nested": [1, 2]}, "goes": True}

"""The claimability rule and the pure transitions, with a pinned clock: no API server."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from tasklease.agent import Identity
from tasklease.api import models
from tasklease.protocol import record
from tasklease.protocol.rules import (
    Blocker,
    TaskView,
    blocker,
    claimed,
    fresh_record,
    requeued,
    why_not_claimable,
)

pytestmark = pytest.mark.unit  # pure logic: `make unit` runs it, on every Python

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def _task(phase: str = "", **spec: object) -> TaskView:
    return TaskView(name="t", namespace="ns", uid="uid-1", spec=models.TaskSpec.model_validate({"queue": "q", **spec}),
                    created="2026-01-01T00:00:00Z", status_phase=phase)


def _free(task: TaskView, **changes: object) -> record.LeaseRecord:
    rec = record.LeaseRecord(name=task.name, namespace=task.namespace, queue="q", owner_uid=task.uid)
    return replace(rec, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize("case, expected", [
    ("never claimed", None),
    ("free", None),
    ("backoff over", None),
    ("finished", Blocker.FINISHED),
    ("foreign", Blocker.FOREIGN),
    ("closed", Blocker.CLOSED),
    ("cancelled", Blocker.CANCELLED),
    ("too deep", Blocker.INVALID_PAYLOAD),
    ("past deadline", Blocker.PAST_DEADLINE),
    ("held", Blocker.HELD),
    ("spent", Blocker.SPENT),
    ("backing off", Blocker.BACKING_OFF),
])
def test_blocker_case_by_case(case: str, expected: Blocker | None) -> None:
    task = _task()
    rec: record.LeaseRecord | None = _free(task, epoch=1)
    if case == "never claimed":
        rec = None
    elif case == "backoff over":
        rec = _free(task, epoch=1, not_before=NOW)
    elif case == "finished":
        task = _task(phase=models.Phase.SUCCEEDED.value)
    elif case == "foreign":
        rec = _free(task, owner_uid="uid-0")
    elif case == "closed":
        rec = _free(task, epoch=1, outcome="Succeeded")
    elif case == "cancelled":
        task = _task(cancel=True)
    elif case == "too deep":
        task = _task(payload=_nested(models.MAX_PAYLOAD_DEPTH + 1))
    elif case == "past deadline":
        task = _task(deadline=NOW.isoformat())
    elif case == "held":
        rec = _free(task, epoch=1, holder="pod/1")
    elif case == "spent":
        rec = _free(task, epoch=3)
    elif case == "backing off":
        rec = _free(task, epoch=1, not_before=NOW + timedelta(seconds=1))
    assert blocker(task, rec, NOW) is expected
    assert (why_not_claimable(task, rec, NOW) is None) == (expected is None)


def test_every_terminal_phase_blocks_even_without_a_lease() -> None:
    for phase in models.TERMINAL_PHASES:
        assert blocker(_task(phase=phase), None, NOW) is Blocker.FINISHED


def test_a_claim_moves_the_epoch_up_by_one_from_the_highest_seen() -> None:
    task = replace(_task(), status_attempt=4)  # the Lease was recreated by hand at epoch 0
    held = claimed(task, _free(task), "pod/1", NOW)
    assert (held.epoch, held.holder, held.state) == (5, "pod/1", record.HELD)


def test_requeue_backs_off_then_dead_letters_when_attempts_are_spent() -> None:
    task = _task(maxAttempts=2, backoff={"initialSeconds": 5, "maxSeconds": 60, "jitter": False})
    first = requeued(claimed(task, None, "pod/1", NOW), task.spec, outcome="Expired", message="", now=NOW,
                     backoff=True)
    assert (first.state, first.not_before) == (record.FREE, NOW + timedelta(seconds=5))
    second = requeued(claimed(task, first, "pod/2", NOW), task.spec, outcome="Failed", message="boom", now=NOW,
                      backoff=True)
    assert (second.state, second.outcome, second.reason) == (record.CLOSED, "Failed", "DeadLettered")
    assert [a.outcome for a in second.history] == ["Expired", "Failed"]


def _nested(depth: int) -> dict[str, object]:
    payload: dict[str, object] = {"leaf": 1}
    for _ in range(depth - 1):
        payload = {"a": payload}
    return payload


def test_payload_depth_counts_objects_and_arrays_without_recursing() -> None:
    assert models.payload_depth({}) == 1 and models.payload_depth(7) == 0
    assert models.payload_depth({"a": [1, {"b": []}]}) == 4
    assert models.payload_depth(_nested(50_000)) == 50_000  # far beyond the recursion limit
    assert blocker(_task(payload=_nested(models.MAX_PAYLOAD_DEPTH)), None, NOW) is None


def test_without_a_lease_the_attempts_the_status_remembers_all_count() -> None:
    """A Lease deleted by hand, or a status written by hand: no retry is remembered, so the
    claim would go past maxAttempts (`E − budget-from`, budget-from 0)."""
    task = _task(maxAttempts=2)
    assert blocker(replace(task, status_attempt=1), None, NOW) is None
    assert blocker(replace(task, status_attempt=2), None, NOW) is Blocker.SPENT
    assert why_not_claimable(replace(task, status_attempt=4), None, NOW) == "attempts spent"


def test_a_first_lease_starts_at_the_epoch_the_status_remembers() -> None:
    assert fresh_record(replace(_task(), status_attempt=4)).epoch == 4
    assert fresh_record(replace(_task(), status_attempt=record.MAX_EPOCH + 9)).epoch == record.MAX_EPOCH  # an int32


def test_a_lowered_epoch_is_never_handed_out_again() -> None:
    task = _task(maxAttempts=5)
    first = claimed(task, None, "pod/1", NOW)
    ended = requeued(first, task.spec, outcome="Released", message="", now=NOW, backoff=False)
    lowered = replace(ended, epoch=0)  # kubectl patch ... leaseTransitions: 0
    assert claimed(task, lowered, "pod/2", NOW).epoch == 2  # above the history's attempt 1
    bare = replace(lowered, history=())  # annotations stripped too: the status still remembers
    assert claimed(replace(task, status_attempt=1), bare, "pod/2", NOW).epoch == 2
    spent = replace(_task(maxAttempts=1), status_attempt=0)
    assert blocker(spent, lowered, NOW) is Blocker.SPENT


def test_no_claim_is_made_past_the_highest_epoch_a_lease_can_hold() -> None:
    # leaseTransitions is an int32: a claim at the next epoch would be refused by the API
    # server, whatever budget `tasklease retry` (budget-from) granted; the task is spent.
    task = _task(maxAttempts=3)
    last = _free(task, epoch=record.MAX_EPOCH - 1, budget_from=record.MAX_EPOCH - 2)
    assert blocker(task, last, NOW) is None
    assert claimed(task, last, "pod/1", NOW).epoch == record.MAX_EPOCH
    assert blocker(task, replace(last, epoch=record.MAX_EPOCH), NOW) is Blocker.SPENT
    assert blocker(replace(task, status_attempt=record.MAX_EPOCH), None, NOW) is Blocker.SPENT  # no Lease left


def test_the_patch_keeps_foreign_labels_and_removes_only_ours() -> None:
    rec = replace(_free(_task(), epoch=2), resource_version="17", history=())
    patch = record.encode_patch(rec)
    meta = patch["metadata"]
    assert meta["resourceVersion"] == "17"  # conditional
    assert set(meta["labels"]) == set(record.OWNED_LABELS)  # only ours: others are left alone
    assert meta["labels"][record.LABEL_HOLDER_POD] is None  # free: the holder label goes
    assert set(meta["annotations"]) == set(record.OWNED_ANNOTATIONS)
    assert meta["annotations"][record.ANN_HISTORY] is None
    assert patch["spec"]["leaseTransitions"] == 2


def test_the_holders_put_is_the_lease_as_read_made_to_say_the_record() -> None:
    held = claimed(_task(), None, "pod/1", NOW)
    read = record.encode(held)
    read["metadata"].update(uid="lease-uid", resourceVersion="17", managedFields=[{"manager": "x"}],
                            finalizers=["example.com/keep"])
    read["metadata"]["labels"]["team"] = "blue"
    read["metadata"]["annotations"]["note"] = "mine"
    rec = record.decode(read)
    freed = requeued(rec, _task().spec, outcome="Released", message="", now=NOW, backoff=False)
    body = record.encode_replacement(freed)
    meta = body["metadata"]
    # Conditional on the version read, and on the uid: a Lease that is gone is not created anew.
    assert (meta["resourceVersion"], meta["uid"]) == ("17", "lease-uid")
    assert meta["managedFields"] == []  # reset: the API server tracks none from then on
    assert meta["finalizers"] == ["example.com/keep"] and meta["labels"]["team"] == "blue"
    assert meta["annotations"]["note"] == "mine"  # what we do not own stays as read
    assert record.LABEL_HOLDER_POD not in meta["labels"]  # ours, removed: the Lease is free
    assert meta["labels"][record.LABEL_STATE] == record.FREE and "holderIdentity" not in body["spec"]
    assert record.decode(body) == freed  # says exactly the record


@pytest.mark.parametrize("change", ["none", "label", "annotation", "holder", "owner"])
def test_what_a_write_leaves_is_the_record_sent_unless_the_answer_says_otherwise(change: str) -> None:
    """A holder keeps its own record after a write (the answer is not decoded again) only
    when the answer holds exactly what it sent; whatever else the answer says (a mutating
    webhook's change) is what the Lease says."""
    held = replace(claimed(_task(), None, "pod/1", NOW), result="r", error="e", budget_from=1)
    sent = record.encode(held)
    answer = record.encode(held)
    answer["metadata"].update(uid="lease-uid", resourceVersion="18", managedFields=[{"manager": "x"}])
    meta, spec = answer["metadata"], answer["spec"]
    if change == "label":
        meta["labels"]["team"] = "blue"
    elif change == "annotation":
        meta["annotations"][record.ANN_RESULT] = "rewritten"
    elif change == "holder":
        spec["holderIdentity"] = "pod/2"
    elif change == "owner":
        meta["ownerReferences"][0]["uid"] = "uid-2"
    after = record.written(held, sent, answer)
    assert after == record.decode(answer) and after.raw is answer and after.resource_version == "18"
    # A label we do not own changes nothing the record says; the others do.
    assert (after == replace(held, resource_version="18")) == (change in ("none", "label"))


def test_status_never_moves_the_attempt_down() -> None:
    from tasklease.operator import projection

    task = {"metadata": {"uid": "uid-1", "generation": 1}, "spec": {"queue": "q"}}
    old = models.TaskStatus(phase=models.Phase.RUNNING, attempt=3)
    lowered = _free(_task(), epoch=0, holder="pod/1")
    assert projection.project(task, lowered, old=old, now=NOW).attempt == 3


def test_the_backoff_formula() -> None:
    exp = models.Backoff(initial_seconds=5, max_seconds=60)
    assert [exp.delay_after(n) for n in range(1, 7)] == [5, 10, 20, 40, 60, 60]
    fixed = models.Backoff(policy=models.BackoffPolicy.FIXED, initial_seconds=7, max_seconds=60)
    assert [fixed.delay_after(n) for n in (1, 5)] == [7, 7]


def test_a_patch_owns_every_label_and_annotation_a_record_writes() -> None:
    """A merge patch only sets (or removes) what it owns: anything `encode` writes must be owned,
    or a patch would silently drop it (as it once dropped a retry's budget)."""
    task = _task()
    full = replace(claimed(task, None, "pod/1", NOW), outcome="Failed", reason="DeadLettered", result="r",
                   error="e", not_before=NOW, budget_from=1)
    meta = record.encode(full)["metadata"]
    assert set(meta["annotations"]) <= set(record.OWNED_ANNOTATIONS)
    assert set(meta["labels"]) <= set(record.OWNED_LABELS)
    # The record above sets them all but the binding to a Pod, which only a held Lease carries.
    assert set(meta["annotations"]) == set(record.OWNED_ANNOTATIONS) - {record.ANN_POD_BOUND}
    bound = record.encode(replace(claimed(task, None, "pod/1", NOW), pod_bound="uid"))["metadata"]
    assert record.ANN_POD_BOUND in bound["annotations"] and set(bound["annotations"]) <= set(record.OWNED_ANNOTATIONS)


def test_a_watchers_decode_keeps_what_claimability_reads_and_drops_history_result_and_raw() -> None:
    """Every agent decodes every Lease change of its queue with `whole=False`: it must judge
    alike (the history, kept as sent, is decoded again for candidates: `QueueView._with_history`)."""
    task = _task(maxAttempts=2)
    full = replace(claimed(task, None, "pod/1", NOW), holder="", outcome="", result="r", error="e",
                   not_before=NOW + timedelta(seconds=5), budget_from=1, resource_version="9")
    lease = record.encode(full)
    lease["metadata"]["resourceVersion"] = "9"
    whole, light = record.decode(lease), record.decode(lease, whole=False)
    assert (light.history, light.result, light.raw) == ((), "", {})
    assert replace(whole, history=(), result="", raw={}) == light
    for now in (NOW, NOW + timedelta(seconds=10)):
        assert blocker(task, light, now) == blocker(task, whole, now)


@pytest.mark.parametrize("holder, pod, instance, uid", [
    ("worker-0/12.345.ab12@0c5e6a1e", "worker-0", "12.345.ab12@0c5e6a1e", "0c5e6a1e"),
    ("worker-0/12.345.ab12", "worker-0", "12.345.ab12", ""),  # an agent without POD_UID
    ("cli-pod/shell.0a1b2c3d@uid-1", "cli-pod", "shell.0a1b2c3d@uid-1", "uid-1"),
])
def test_a_holder_names_its_pod_its_instance_and_perhaps_its_pod_uid(holder: str, pod: str, instance: str,
                                                                      uid: str) -> None:
    assert (record.holder_pod(holder), record.holder_instance(holder), record.holder_pod_uid(holder)) == (
        pod, instance, uid)


def test_a_holder_names_its_pod_by_the_first_8_characters_of_its_uid() -> None:
    uid = "0c5e6a1e-7f1f-4b59-9a57-2b1e3a3c9d10"
    holder = Identity(pod="worker-0", instance="12.345.ab12", pod_uid=uid).holder
    assert holder == "worker-0/12.345.ab12@0c5e6a1e" and record.holder_pod_uid(holder) == record.short_uid(uid)
    assert Identity(pod="worker-0", instance="12.345.ab12").holder == "worker-0/12.345.ab12"

"""`LeaseRecord`: what a Lease says, decoded from and encoded to the wire in one place.

Like client-go's resourcelock, the record is neutral: the transitions (`rules`) change
records, never JSON. A record without an owner (the operator's election Lease) encodes
without the task labels, so no watch of task Leases ever sees it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Final

from pydantic import TypeAdapter

from tasklease.api import models
from tasklease.api.timestamps import format_time, parse_time
from tasklease.kube import JSON

LABEL_MANAGED: Final = "app.kubernetes.io/managed-by"
LABEL_QUEUE: Final = "tasklease.dev/queue"
LABEL_STATE: Final = "tasklease.dev/state"
LABEL_HOLDER_POD: Final = "tasklease.dev/holder-pod"
ANN_OUTCOME: Final = "tasklease.dev/outcome"
ANN_REASON: Final = "tasklease.dev/reason"
ANN_RESULT: Final = "tasklease.dev/result"
ANN_ERROR: Final = "tasklease.dev/error"
ANN_NOT_BEFORE: Final = "tasklease.dev/not-before"
ANN_HISTORY: Final = "tasklease.dev/history"
ANN_BUDGET_FROM: Final = "tasklease.dev/budget-from"
# The uid of the holder's Pod, when the holder asked the operator to keep its lease alive
# while that Pod runs (docs/pod-bound.md). Only on a held Lease.
ANN_POD_BOUND: Final = "tasklease.dev/pod-bound"

MANAGED_SELECTOR: Final = f"{LABEL_MANAGED}=tasklease"
# What our writes own; any other label or annotation on a Lease is left as it is.
OWNED_LABELS: Final = (LABEL_MANAGED, LABEL_QUEUE, LABEL_STATE, LABEL_HOLDER_POD)
OWNED_ANNOTATIONS: Final = (ANN_OUTCOME, ANN_REASON, ANN_RESULT, ANN_ERROR, ANN_NOT_BEFORE, ANN_HISTORY,
                             ANN_BUDGET_FROM, ANN_POD_BOUND)

FREE, HELD, CLOSED = "free", "held", "closed"
# A Lease's leaseTransitions is an int32: the highest fencing epoch there can be. An attempt
# named above it was handed out by no claim.
MAX_EPOCH: Final = 2**31 - 1
_DEFAULT_DURATION_S: Final = int(models.TaskSpec.model_fields["lease_duration_seconds"].default)
# The history annotation in one call each way (cheaper than an Attempt at a time): it is
# read and written back on every write of a holder.
_HISTORY: Final = TypeAdapter(tuple[models.Attempt, ...])


# -- the neutral record ---------------------------------------------------------------


@dataclass(frozen=True)
class LeaseRecord:
    """What a Lease says, free of the Lease's wire format."""

    name: str
    namespace: str
    queue: str
    owner_uid: str
    holder: str = ""
    epoch: int = 0
    duration_s: int = _DEFAULT_DURATION_S
    acquired_at: datetime | None = None
    renewed_at: datetime | None = None
    outcome: str = ""  # Succeeded | Failed | Cancelled when closed
    reason: str = ""
    result: str = ""
    error: str = ""
    not_before: datetime | None = None
    history: tuple[models.Attempt, ...] = ()
    # `tasklease retry` grants maxAttempts more claims from this epoch on; the epoch itself never goes back.
    budget_from: int = 0
    pod_bound: str = ""  # the holder's Pod uid, while the operator keeps the lease alive for it
    resource_version: str = ""
    # What could not be read (`MALFORMED_REASONS`), left out or marked: see `decode`.
    malformed: tuple[str, ...] = field(default=(), compare=False)
    raw: JSON = field(default_factory=dict, compare=False, repr=False)

    @property
    def state(self) -> str:
        return _state(self.outcome, self.holder)

    @property
    def holder_pod(self) -> str:
        return holder_pod(self.holder)

    @property
    def holder_pod_uid(self) -> str:
        return holder_pod_uid(self.holder)


def _state(outcome: str, holder: str) -> str:
    if outcome:
        return CLOSED
    return HELD if holder else FREE


def holder_pod(holder: str) -> str:
    """`<pod>/<instance>[@<pod uid>]` → `<pod>`."""
    return holder.rsplit("/", 1)[0] if "/" in holder else holder


def holder_instance(holder: str) -> str:
    """`<pod>/<instance>[@<pod uid>]` → `<instance>[@<pod uid>]`."""
    return holder.rsplit("/", 1)[1] if "/" in holder else ""


def holder_pod_uid(holder: str) -> str:
    """`<pod>/<instance>@<pod uid>` → `<pod uid>` (its `short_uid`); "" for a holder that names
    no uid (an agent without POD_UID). It tells a pod from a later one of the same name."""
    instance = holder_instance(holder)
    return instance.rpartition("@")[2] if "@" in instance else ""


def short_uid(uid: str) -> str:
    """How a holder names its pod's uid: the first 8 characters (of a random UUID) tell a pod
    from its namesakes, and keep the HOLDER column of `kubectl get tasks` readable."""
    return uid[:8]


def decode(lease: JSON, *, whole: bool = True) -> LeaseRecord:
    """`whole=False`: what a watcher judges a Lease by, for one that sees every change of a
    queue: no history (only a claim writes it back), no result, and no raw object kept.

    Never fails on what a writer put in a field: a value that cannot be read (history that is
    not JSON, an unknown outcome, a bad time or number) is left out, and `malformed` says
    which (`MALFORMED_REASONS`); a value longer than the Task's status can hold is kept, and
    marked. Readers carry on with the rest; the operator reports it."""
    meta = lease.get("metadata") or {}
    spec = lease.get("spec") or {}
    ann = _strings(meta.get("annotations"))
    labels = _strings(meta.get("labels"))
    bad: list[str] = []
    owners = [o for o in meta.get("ownerReferences") or [] if isinstance(o, dict) and o.get("kind") == models.KIND]
    history = _history(ann.get(ANN_HISTORY, ""), bad) if whole else ()
    outcome = ann.get(ANN_OUTCOME, "")
    if outcome and outcome not in models.TERMINAL_PHASES:
        bad.append("outcome")
        outcome = ""
    holder = str(spec.get("holderIdentity") or "")
    reason, result, error = ann.get(ANN_REASON, ""), ann.get(ANN_RESULT, "") if whole else "", ann.get(ANN_ERROR, "")
    if (len(holder) > MAX_HOLDER_CHARS or len(reason) > MAX_REASON_CHARS or len(result) > models.MAX_RESULT_BYTES
            or len(error) > models.MAX_ERROR_CHARS):
        bad.append("too-long")
    if LABEL_MANAGED in labels and labels.get(LABEL_STATE) != _state(outcome, holder):
        bad.append("state-label")  # hidden from the agents' watch of free Leases, or shown there held
    return LeaseRecord(
        name=meta["name"], namespace=meta["namespace"], queue=labels.get(LABEL_QUEUE, ""),
        owner_uid=str(owners[0].get("uid") or "") if owners else "",
        holder=holder, epoch=_number(spec.get("leaseTransitions"), 0, bad),
        duration_s=_number(spec.get("leaseDurationSeconds"), _DEFAULT_DURATION_S, bad) or _DEFAULT_DURATION_S,
        acquired_at=_time(spec.get("acquireTime"), bad), renewed_at=_time(spec.get("renewTime"), bad),
        outcome=outcome, reason=reason, result=result, error=error,
        not_before=_time(ann.get(ANN_NOT_BEFORE), bad),
        history=history, budget_from=_number(ann.get(ANN_BUDGET_FROM), 0, bad),
        pod_bound=ann.get(ANN_POD_BOUND, "") if holder and not outcome else "",
        resource_version=str(meta.get("resourceVersion", "")), raw=lease if whole else {},
        malformed=tuple(dict.fromkeys(bad)),
    )


def read(lease: JSON) -> LeaseRecord | None:
    """`decode`, or None for a Lease that cannot be read at all (no namespace or name, or a
    metadata or spec that is no object): nothing to decide with."""
    try:
        return decode(lease)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


MALFORMED_REASONS: Final = ("history", "outcome", "timestamp", "number", "too-long", "state-label")
DROPPED_REASONS: Final = MALFORMED_REASONS[:4]  # left out by `decode`; "too-long" values are kept
# What Task.status holds of a Lease's holder and reason (models.TaskStatus).
MAX_HOLDER_CHARS: Final = int(models.TaskStatus.model_fields["holder"].metadata[0].max_length)
MAX_REASON_CHARS: Final = int(models.TaskStatus.model_fields["reason"].metadata[0].max_length)


def decode_history(text: str) -> tuple[models.Attempt, ...]:
    """A history annotation; () when it cannot be read (the next claim writes a new one)."""
    return _history(text, [])


def _history(text: str, bad: list[str]) -> tuple[models.Attempt, ...]:
    if not text:
        return ()
    try:
        history = _HISTORY.validate_json(text)
    except ValueError:  # not JSON, not attempts, or nested past the parser's limit
        bad.append("history")
        return ()
    if any(entry.attempt > MAX_EPOCH for entry in history):
        bad.append("history")  # remembered, it would fence every claim out, and fail the status write
        return ()
    return history


def _strings(value: object) -> dict[str, str]:
    return {str(k): str(v) for k, v in value.items()} if isinstance(value, dict) else {}


def _time(value: object, bad: list[str]) -> datetime | None:
    try:
        parsed = parse_time(value)
    except (TypeError, ValueError):
        bad.append("timestamp")
        return None
    if parsed is not None and parsed.tzinfo is None:
        bad.append("timestamp")  # a time without a zone is nobody's clock
        return None
    return parsed


def _number(value: object, default: int, bad: list[str]) -> int:
    if value is None or value == "":
        return default
    try:
        number = int(str(value))
    except ValueError:
        bad.append("number")
        return default
    if number < 0:
        bad.append("number")
        return default
    return number


def encode(rec: LeaseRecord) -> JSON:
    """The whole Lease for a PUT (or POST): carries rec.resource_version as the precondition."""
    meta: JSON = {"name": rec.name, "namespace": rec.namespace, "annotations": {}}
    if rec.owner_uid:  # a task's Lease: labelled for the watches, owned for the garbage collector
        meta["labels"] = {LABEL_MANAGED: "tasklease", LABEL_QUEUE: rec.queue, LABEL_STATE: rec.state}
        meta["ownerReferences"] = [{
            "apiVersion": f"{models.GROUP}/{models.VERSION}", "kind": models.KIND, "name": rec.name,
            "uid": rec.owner_uid, "controller": True, "blockOwnerDeletion": False,
        }]
        if rec.holder:
            meta["labels"][LABEL_HOLDER_POD] = label_value(rec.holder_pod)
    if rec.resource_version:
        meta["resourceVersion"] = rec.resource_version
    ann = meta["annotations"]
    for key, value in ((ANN_OUTCOME, rec.outcome), (ANN_REASON, rec.reason), (ANN_RESULT, rec.result),
                       (ANN_ERROR, rec.error), (ANN_NOT_BEFORE, format_time(rec.not_before)),
                       (ANN_BUDGET_FROM, str(rec.budget_from) if rec.budget_from else ""),
                       (ANN_POD_BOUND, rec.pod_bound if rec.state == HELD else "")):
        if value:
            ann[key] = value
    if rec.history:
        ann[ANN_HISTORY] = _HISTORY.dump_json(rec.history, by_alias=True, exclude_defaults=True).decode()
    spec: JSON = {"leaseDurationSeconds": rec.duration_s, "leaseTransitions": rec.epoch,
                  "holderIdentity": rec.holder or None,
                  "acquireTime": format_time(rec.acquired_at), "renewTime": format_time(rec.renewed_at)}
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}


def written(rec: LeaseRecord, sent: JSON, answer: JSON) -> LeaseRecord:
    """What the Lease says once the API server accepted `sent` (a whole Lease, `encode(rec)`
    or `encode_replacement(rec)`) and answered `answer`: `rec` itself, at the answer's
    resourceVersion, when the answer holds what was sent; decoded whole otherwise (a mutating
    webhook changed it). A holder writes on every claim and every ending: decoding the answer
    whole, history included, was a third of the Python time a claim spends around its request."""
    meta, kept = sent["metadata"], answer.get("metadata", {})
    spec = answer.get("spec", {})
    if (all(spec.get(k) == v for k, v in sent["spec"].items())
            and (kept.get("labels") or {}) == (meta.get("labels") or {})
            and (kept.get("annotations") or {}) == (meta.get("annotations") or {})
            and kept.get("ownerReferences") == meta.get("ownerReferences")):
        return replace(rec, resource_version=kept.get("resourceVersion", ""), raw=answer)
    return decode(answer)


def encode_patch(rec: LeaseRecord) -> JSON:
    """A JSON merge patch that makes the Lease say `rec`: conditional on rec.resource_version
    (409 if it moved) and, unlike a PUT, never a create (404 if the Lease is gone: Leases
    allow create-on-update, and only a claim may create one). Labels and annotations we do
    not own stay as they are; ours are set, or removed (null) when `rec` has none."""
    full = encode(rec)
    meta = full["metadata"]
    # No managedFields: the API server resets them on this write, and tracks none on any later
    # update of an object that has none (only a create or a server-side apply starts again).
    # Nothing reads them on a task's Lease, and tracking them is the costliest step of a
    # write for the API server, and makes the Lease larger.
    patch_meta: JSON = {"resourceVersion": rec.resource_version, "managedFields": [],
                        "annotations": {k: meta["annotations"].get(k) for k in OWNED_ANNOTATIONS}}
    if rec.owner_uid:
        patch_meta["labels"] = {k: meta["labels"].get(k) for k in OWNED_LABELS}
        patch_meta["ownerReferences"] = meta["ownerReferences"]
    return {"metadata": patch_meta, "spec": full["spec"]}


def encode_replacement(rec: LeaseRecord) -> JSON:
    """The whole Lease for a PUT: `rec.raw` (the Lease as read, which `rec` was made from)
    as `encode_patch(rec)` would leave it on the API server. It carries the Lease's uid as
    well as its resourceVersion: a Lease that is gone is then a 409, never created anew
    (Leases allow create-on-update; a uid precondition cannot match a Lease that is not
    there). The API server spends less on a PUT than on applying a merge patch; what we
    do not own stays as it was read, and a change to it since is a 409 like any other."""
    return _merged(rec.raw, encode_patch(rec))


def _merged(target: JSON, patch: JSON) -> JSON:
    """`patch` applied to `target` as a JSON merge patch (RFC 7386): null removes."""
    out = dict(target)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict):
            below = out.get(key)
            out[key] = _merged(below if isinstance(below, dict) else {}, value)
        else:
            out[key] = value
    return out


def label_value(value: str) -> str:
    """Pod names longer than a label value allows are cut; the holder itself stays exact."""
    return value[:63].rstrip("-_.")

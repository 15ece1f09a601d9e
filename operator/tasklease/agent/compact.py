"""An open task in under a hundred bytes: what `TaskView.of` reads, and nothing else.

An agent keeps every open task of its queue; a TaskView takes about two kilobytes. Kept
instead: the uid as its 16 bytes (a UUID, as the API server writes it), the creation time
as five bytes of seconds (when it reads back the same text), then the rest as compact JSON
without what the common task has: the spec's defaults, the view's queue, the status of a
task not attempted yet. The views are decoded again on demand.
"""

from __future__ import annotations

import functools
import json
import time
from datetime import datetime
from typing import Any, Final

from tasklease.api import models
from tasklease.kube import JSON
from tasklease.protocol import TaskView

# The spec's defaults as the API server writes them: a field equal to its default is not
# kept, as validating the rest gives it back.
_SPEC_DEFAULTS: Final = {k: v for k, v in models.TaskSpec.model_validate({"queue": "q"}).model_dump(
    mode="json", by_alias=True).items() if k != "queue"}  # the queue has none
_UUID: Final = 0  # the first byte: the uid follows as 16 bytes; else the length of its text
_SECONDS: Final = 255  # the creation time's first byte: 5 bytes of seconds follow; else its length
_TIME: Final = "%Y-%m-%dT%H:%M:%SZ"  # how the API server writes a creationTimestamp
_JSON: Final = json.JSONEncoder(separators=(",", ":"))
_PENDING: Final = b"P"  # before the rest: a first attempt's status, Pending (JSON never starts so)


def compact(task: JSON, *, queue: str = "") -> bytes:
    """What `TaskView.of` reads from a Task but its name and namespace (`expand` puts them
    back), and its `spec.queue` when it is `queue` (the queue the caller watches)."""
    meta, status = task["metadata"], task.get("status") or {}
    return _uid(str(meta["uid"])) + _created(str(meta.get("creationTimestamp", ""))) + _rest(
        {k: v for k, v in (task.get("spec") or {}).items()
         if _SPEC_DEFAULTS.get(k, ...) != v and not (k == "queue" and v == queue and queue)},
        status.get("attempt") or 0, status.get("phase") or "")


def expand(data: bytes, *, name: str, namespace: str, queue: str = "") -> TaskView:
    """The view `compact(task, queue=queue)` was made from."""
    at = _uid_size(data)
    uid = _text(data[1:at]) if data[0] == _UUID else data[1:at].decode()
    if data[at] == _SECONDS:
        created, at = _time(int.from_bytes(data[at + 1:at + 6], "big")), at + 6
    else:
        created, at = data[at + 1:at + 1 + data[at]].decode(), at + 1 + data[at]
    pending = data[at:at + 1] == _PENDING
    at += pending
    rest = json.loads(data[at:]) if len(data) > at else {}
    spec, attempt, phase = (rest, 0, models.Phase.PENDING.value if pending else "") if isinstance(rest, dict) else rest
    if queue:
        spec.setdefault("queue", queue)
    return TaskView.of({"metadata": {"name": name, "namespace": namespace, "uid": uid, "creationTimestamp": created},
                        "spec": spec, "status": {"attempt": attempt, "phase": phase}})


def same_task(a: bytes, b: bytes) -> bool:
    """Were `a` and `b` compacted from the same task (the same uid), whatever else changed?"""
    return a[:_uid_size(a)] == b[:_uid_size(b)]


def _uid_size(data: bytes) -> int:
    return 17 if data[0] == _UUID else 1 + data[0]


def _uid(uid: str) -> bytes:
    digits = uid.replace("-", "")
    if len(uid) == 36 and len(digits) == 32:  # then read back: exactly as the API server writes one
        try:
            packed = bytes.fromhex(digits)
        except ValueError:
            packed = b""
        if packed and _text(packed) == uid:
            return bytes([_UUID]) + packed
    text = uid.encode()
    if not 0 < len(text) < 256:
        raise ValueError(f"a uid of {len(text)} bytes")
    return bytes([len(text)]) + text


def _text(packed: bytes) -> str:
    """A UUID's 16 bytes as the API server writes it (as `str(uuid.UUID(bytes=packed))`)."""
    h = packed.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


# Tasks created together share their creation time: each is packed and unpacked once (and
# the views decoded again share its text).
@functools.lru_cache(maxsize=64)
def _time(seconds: int) -> str:
    return time.strftime(_TIME, time.gmtime(seconds))


@functools.lru_cache(maxsize=64)
def _created(created: str) -> bytes:
    try:
        at = datetime.fromisoformat(created) if len(created) == 20 else None
    except ValueError:
        at = None
    seconds = int(at.timestamp()) if at is not None and at.tzinfo is not None else -1
    if 0 <= seconds < 2**40 and _time(seconds) == created:
        return bytes([_SECONDS]) + seconds.to_bytes(5, "big")
    text = created.encode()
    if len(text) >= _SECONDS:
        raise ValueError(f"a creationTimestamp of {len(text)} bytes")
    return bytes([len(text)]) + text


def _rest(spec: dict[str, Any], attempt: int, phase: str) -> bytes:
    """For a task never attempted, the spec alone (nothing at all for a spec of defaults), after
    `_PENDING` when its status says Pending (the CRD's default); else [spec, attempt, phase]."""
    if not attempt and phase in ("", models.Phase.PENDING):
        return (_PENDING if phase else b"") + (_JSON.encode(spec).encode() if spec else b"")
    return _JSON.encode([spec, attempt, phase]).encode()

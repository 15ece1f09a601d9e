"""An open task in under a hundred bytes: what `TaskView.of` reads, and nothing else.

An agent keeps every open task of its queue; a TaskView takes about two kilobytes. Kept
instead: the uid as its 16 bytes (a UUID, as the API server writes it), the creation time,
then the rest as compact JSON without the spec's defaults. The views are decoded again on demand.
"""

from __future__ import annotations

import json
import uuid
from typing import Final

from tasklease.api import models
from tasklease.kube import JSON
from tasklease.protocol import TaskView

# The spec's defaults as the API server writes them: a field equal to its default is not
# kept, as validating the rest gives it back.
_SPEC_DEFAULTS: Final = {k: v for k, v in models.TaskSpec.model_validate({"queue": "q"}).model_dump(
    mode="json", by_alias=True).items() if k != "queue"}  # the queue has none
_UUID: Final = 0  # the first byte: the uid follows as 16 bytes; else the length of its text


def compact(task: JSON) -> bytes:
    """What `TaskView.of` reads from a Task but its name and namespace (`expand` puts them back)."""
    meta, status = task["metadata"], task.get("status") or {}
    uid, created = str(meta["uid"]), str(meta.get("creationTimestamp", "")).encode()
    try:
        packed = uuid.UUID(uid)
        head = bytes([_UUID]) + packed.bytes if str(packed) == uid else b""
    except ValueError:
        head = b""
    if not head:
        text = uid.encode()
        if not 0 < len(text) < 256:
            raise ValueError(f"a uid of {len(text)} bytes")
        head = bytes([len(text)]) + text
    rest = [{k: v for k, v in (task.get("spec") or {}).items() if _SPEC_DEFAULTS.get(k, ...) != v},
            status.get("attempt") or 0, status.get("phase") or ""]
    return head + bytes([len(created)]) + created + json.dumps(rest, separators=(",", ":")).encode()


def expand(data: bytes, *, name: str, namespace: str) -> TaskView:
    size = data[0]
    if size == _UUID:
        uid, at = str(uuid.UUID(bytes=data[1:17])), 17
    else:
        uid, at = data[1:1 + size].decode(), 1 + size
    created = data[at + 1:at + 1 + data[at]].decode()
    spec, attempt, phase = json.loads(data[at + 1 + data[at]:])
    return TaskView.of({"metadata": {"name": name, "namespace": namespace, "uid": uid, "creationTimestamp": created},
                        "spec": spec, "status": {"attempt": attempt, "phase": phase}})

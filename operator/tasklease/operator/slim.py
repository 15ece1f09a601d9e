"""What the operator keeps of a Task between its events: a few fields and deflated compact JSON.

Every Task costs memory for as long as it exists, at every queue depth: as nested dicts
a projected Task is about 3 KB, as compact JSON 840 bytes, deflated against a dictionary
of what every Task has in common (keys, defaults, the two conditions) about 150. It is
inflated (a few microseconds) only to reconcile it. The dictionary lives in this process
only: what it contains changes how small a Task gets, never what comes back.
"""

from __future__ import annotations

import json
import sys
import zlib
from dataclasses import dataclass

from tasklease.api import models
from tasklease.kube import JSON

# What a decision or a status write needs of a Task's metadata; the rest (managedFields,
# annotations) stays with the API server.
KEPT_METADATA = ("name", "namespace", "uid", "resourceVersion", "generation", "creationTimestamp")
_WBITS = -15  # a raw deflate stream: no header or checksum for data that never leaves memory


def _common() -> bytes:
    """A made-up Task with every key and default a real one has, as the API server orders them."""
    condition = {"lastTransitionTime": "", "message": "", "observedGeneration": 1, "status": "False"}
    task = {"apiVersion": f"{models.GROUP}/{models.VERSION}", "kind": models.KIND,
            "metadata": dict.fromkeys(KEPT_METADATA, ""),
            "spec": models.TaskSpec(queue="q").model_dump(mode="json", by_alias=True, exclude={"payload"}),
            "status": {**models.TaskStatus().model_dump(mode="json", by_alias=True, exclude_none=True),
                       "conditions": [{**condition, "reason": "NotHeld", "type": "Held"},
                                      {**condition, "reason": "NotFinished", "type": "Finished"}],
                       "reason": "Waiting"}}
    return json.dumps(task, separators=(",", ":"), sort_keys=True).encode()


_COMMON = _common()


@dataclass(slots=True)
class SlimTask:
    """One Task as the reconciler keeps it: the two fields read without reconciling it (they
    feed the metrics), and the rest deflated."""

    queue: str
    created: str  # metadata.creationTimestamp
    packed: bytes

    def json(self) -> JSON:
        inflate = zlib.decompressobj(_WBITS, zdict=_COMMON)
        task: JSON = json.loads(inflate.decompress(self.packed) + inflate.flush())
        return task


def slim(task: JSON) -> SlimTask:
    """Enough of `task` to decide and to write its status. The payload is left out (a status
    write takes the spec from the stored Task): only whether it is nested too deeply matters
    here, and a payload nested too deeply is kept to say so."""
    meta = task["metadata"]
    spec: JSON = task.get("spec") or {}
    if models.payload_depth(spec.get("payload")) <= models.MAX_PAYLOAD_DEPTH:
        spec = {k: v for k, v in spec.items() if k != "payload"}
    body = {"apiVersion": task.get("apiVersion"), "kind": task.get("kind"),
            "metadata": {k: meta[k] for k in KEPT_METADATA if k in meta}, "spec": spec, "status": task.get("status")}
    deflate = zlib.compressobj(6, zlib.DEFLATED, _WBITS, zdict=_COMMON)
    packed = deflate.compress(json.dumps(body, separators=(",", ":")).encode()) + deflate.flush()
    # Interned: thousands of Tasks share a queue and a creation second.
    return SlimTask(queue=sys.intern(str(spec.get("queue", ""))),
                    created=sys.intern(str(meta.get("creationTimestamp", ""))), packed=packed)

"""An open task as a few hundred bytes: what `TaskView.of` reads, and nothing else.

An agent keeps every open task of its queue; a TaskView takes about two kilobytes, its compact
JSON a few hundred bytes. The views are decoded again on demand.
"""

from __future__ import annotations

import json
from typing import Final

from tasklease.api import models
from tasklease.kube import JSON
from tasklease.protocol import TaskView

# The spec's defaults as the API server writes them: a field equal to its default is not
# kept, as validating the rest gives it back.
_SPEC_DEFAULTS: Final = {k: v for k, v in models.TaskSpec.model_validate({"queue": "q"}).model_dump(
    mode="json", by_alias=True).items() if k != "queue"}  # the queue has none


def compact(task: JSON) -> bytes:
    """What `TaskView.of` reads from a Task but its name and namespace (`expand` puts them
    back), without the spec's defaults, as compact JSON."""
    meta, status = task["metadata"], task.get("status") or {}
    slim = {"metadata": {k: meta[k] for k in ("uid", "creationTimestamp") if k in meta},
            "spec": {k: v for k, v in (task.get("spec") or {}).items() if _SPEC_DEFAULTS.get(k, ...) != v},
            "status": {k: status[k] for k in ("attempt", "phase") if k in status}}
    return json.dumps(slim, separators=(",", ":")).encode()


def expand(text: bytes, *, name: str, namespace: str) -> TaskView:
    task = json.loads(text)
    task["metadata"].update(name=name, namespace=namespace)
    return TaskView.of(task)

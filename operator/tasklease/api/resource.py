"""Where the Task lives in the API: group, version, plural, kind. Nothing else, so the
`kube` layer can address Tasks without loading the pydantic models."""

from __future__ import annotations

from typing import Final

GROUP: Final = "tasklease.dev"
VERSION: Final = "v1alpha1"
PLURAL: Final = "tasks"
KIND: Final = "Task"

# The optional TaskQueue: named as the queue it controls, in the same namespace.
QUEUE_PLURAL: Final = "taskqueues"
QUEUE_KIND: Final = "TaskQueue"

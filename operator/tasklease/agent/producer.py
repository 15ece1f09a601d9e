"""The producer SDK: create and follow work from a program, as `tasklease`/kubectl do by hand.

    producer = Producer.connect(namespace="shop")
    producer.submit("resize-42", TaskSpec(queue="images", payload={"id": 42}))   # the name is the key
    task = producer.wait("resize-42", timeout=600)                               # watch-driven
    print(task.status.phase, task.status.result)

Names are idempotency keys: submitting a name again with the same spec returns the task that
exists (a retried submission after a lost answer is harmless); with another spec it is a
`Conflict`. Everything is typed with the models of `tasklease.api.models`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tasklease.api import errors, models
from tasklease.kube import JSON, TASKS, Kube
from tasklease.protocol import Protocol, TaskView
from tasklease.protocol.labels import labelled

_WATCH_S = 60


class Task(BaseModel):
    """A Task as the API server has it: identity, spec and the operator's status."""

    model_config = ConfigDict(frozen=True)

    name: str
    namespace: str
    uid: str
    labels: dict[str, str] = Field(default_factory=dict)
    created: str = ""
    resource_version: str = ""
    spec: models.TaskSpec
    status: models.TaskStatus

    @classmethod
    def of(cls, obj: JSON) -> Task:
        meta = obj["metadata"]
        return cls(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"], labels=meta.get("labels") or {},
                   created=meta.get("creationTimestamp", ""), resource_version=meta.get("resourceVersion", ""),
                   spec=models.TaskSpec.model_validate(obj.get("spec") or {}),
                   status=models.TaskStatus.model_validate(obj.get("status") or {}))

    @property
    def finished(self) -> bool:
        return self.status.phase.terminal


def body(name: str | None, spec: models.TaskSpec, *, labels: Mapping[str, str] | None = None,
         generate_name: str | None = None) -> JSON:
    """The Task object to create: only the fields set on `spec` are sent (the API server fills
    defaults). `name` None: a generated one; "" is no name, and no idempotency key either."""
    if name == "":
        raise errors.Invalid("a task's name cannot be empty: pass None for a generated name")
    meta: JSON = {"name": name} if name is not None else {"generateName": generate_name or f"{spec.queue}-"}
    if labels:
        meta["labels"] = dict(labels)
    return {"apiVersion": f"{models.GROUP}/{models.VERSION}", "kind": models.KIND, "metadata": meta,
            "spec": spec.model_dump(mode="json", by_alias=True, exclude_unset=True)}


def same_spec(existing: Mapping[str, Any], wanted: Mapping[str, Any]) -> bool:
    """`wanted` as the API server would store it (defaults filled in) equals `existing`."""
    try:
        return bool(models.TaskSpec.model_validate(existing).model_dump(mode="json")
                    == models.TaskSpec.model_validate(wanted).model_dump(mode="json"))
    except ValueError:
        return False


class Producer:
    """Submit, follow, cancel and retry tasks in one namespace. Thread-safe."""

    def __init__(self, kube: Kube, *, namespace: str | None = None) -> None:
        self.kube = kube
        self.namespace = namespace or kube.namespace

    @classmethod
    def connect(cls, *, kubeconfig: str | None = None, context: str | None = None,
                namespace: str | None = None) -> Producer:
        return cls(Kube.connect(kubeconfig=kubeconfig, context=context, namespace=namespace), namespace=namespace)

    def submit(self, name: str | None, spec: models.TaskSpec, *, labels: Mapping[str, str] | None = None) -> Task:
        """Create one task. `name` None: a generated name (no idempotency). An existing task of
        that name and the same spec is returned as it is; another spec raises Conflict."""
        return self.create(body(name, spec, labels=labels))

    def submit_many(self, tasks: Iterable[tuple[str, models.TaskSpec]]) -> list[Task]:
        """Create several; each name is its idempotency key, so the whole call may be repeated."""
        return [self.submit(name, spec) for name, spec in tasks]

    def create(self, obj: JSON) -> Task:
        """Create the Task object `obj` (as read from YAML), idempotently by name."""
        namespace = (obj.get("metadata") or {}).get("namespace") or self.namespace
        try:
            return Task.of(self.kube.create(TASKS, labelled(obj), namespace=namespace))
        except errors.Conflict:
            name = (obj.get("metadata") or {}).get("name") or ""
            existing = self.kube.get(TASKS, name, namespace=namespace)
            if same_spec(existing.get("spec") or {}, obj.get("spec") or {}):
                return Task.of(existing)
            raise errors.Conflict(f"task {namespace}/{name} already exists with another spec") from None

    def get(self, name: str) -> Task:
        return Task.of(self.kube.get(TASKS, name, namespace=self.namespace))

    def list(self, *, queue: str | None = None, phase: models.Phase | None = None, selector: str = "") -> list[Task]:
        """Tasks of the namespace, filtered by the API server (phase: as the operator projected it)."""
        fields = [f for f in (f"spec.queue={queue}" if queue else "",
                              f"status.phase={phase.value}" if phase else "") if f]
        listed = self.kube.list(TASKS, namespace=self.namespace, label_selector=selector,
                                field_selector=",".join(fields))
        return [Task.of(t) for t in listed["items"]]

    def wait(self, name: str, *, timeout: float | None = None) -> Task:
        """Until the task is finished (Succeeded, Failed or Cancelled): a watch on this one
        task, no polling. TimeoutError after `timeout` seconds; NotFound if it is deleted."""
        give_up = None if timeout is None else time.monotonic() + timeout
        obj = self.kube.get(TASKS, name, namespace=self.namespace)
        uid = obj["metadata"]["uid"]
        while True:
            task = Task.of(obj)
            if task.finished:
                return task
            left = _WATCH_S if give_up is None else give_up - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"task {self.namespace}/{name} is still {task.status.phase.value} "
                                   f"after {timeout:g}s")
            obj = self._next_version(name, uid, obj, min(left, _WATCH_S))

    def cancel(self, name: str) -> Task:
        """Ask for the task to end Cancelled; its holder stops at once (the operator closes it)."""
        return Task.of(self.kube.merge_patch(TASKS, name, {"spec": {"cancel": True}}, namespace=self.namespace))

    def retry(self, name: str) -> Task:
        """A Failed (dead-lettered) task gets a fresh budget of maxAttempts; its history and
        epoch go on. Invalid for any other task: a Succeeded one is never re-run."""
        obj = self.kube.get(TASKS, name, namespace=self.namespace)
        protocol = Protocol(self.kube)
        protocol.retry(TaskView.of(obj), protocol.read(self.namespace, name))
        return Task.of(obj)

    def _next_version(self, name: str, uid: str, current: JSON, timeout_s: float) -> JSON:
        """The task's next version, or `current` when nothing changed within `timeout_s`
        (the server's bound is whole seconds; a silence of `timeout_s` ends it sooner)."""
        version = current["metadata"]["resourceVersion"]
        try:
            for event in self.kube.watch(TASKS, namespace=self.namespace, resource_version=version,
                                         field_selector=f"metadata.name={name}", timeout_s=math.ceil(timeout_s),
                                         quiet_s=timeout_s):
                obj = event["object"]
                if event["type"] == "ERROR":
                    raise errors.Gone(str(obj.get("message", "")))
                if event["type"] == "BOOKMARK":
                    continue
                if event["type"] == "DELETED" or obj["metadata"]["uid"] != uid:
                    raise errors.NotFound(f"task {self.namespace}/{name} was deleted while waiting for it")
                return dict(obj)
        except (errors.Gone, errors.Unreachable):
            fresh = self.kube.get_or_none(TASKS, name, namespace=self.namespace)
            if fresh is None or fresh["metadata"]["uid"] != uid:
                raise errors.NotFound(f"task {self.namespace}/{name} was deleted while waiting for it") from None
            return fresh
        return current

"""A Kube stand-in for the operator's pure decisions: objects in a dict, resourceVersion
preconditions honoured, every write kept in order. Millisecond tests; no API server."""

from __future__ import annotations

import copy
from typing import Any

from tasklease.api import errors
from tasklease.kube import EVENTS, JSON, Resource


def _merged(target: JSON, patch: JSON) -> JSON:
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


class FakeKube:
    namespace = "ns"

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], JSON] = {}
        self.writes: list[tuple[str, str, JSON]] = []  # (verb, plural, body)
        self._rv = 100

    def put(self, res: Resource, obj: JSON) -> JSON:
        """Store `obj` as if written by someone else; returns it with its new resourceVersion."""
        obj = copy.deepcopy(obj)
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        obj["metadata"].setdefault("uid", f"uid-{obj['metadata']['name']}")
        self.objects[(res.plural, obj["metadata"]["namespace"], obj["metadata"]["name"])] = obj
        return copy.deepcopy(obj)

    def get_or_none(self, res: Resource, name: str, *, namespace: str | None = None,
                    timeout: float = 30) -> JSON | None:
        obj = self.objects.get((res.plural, namespace or self.namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    def merge_patch(self, res: Resource, name: str, patch: JSON, *, namespace: str | None = None,
                    timeout: float = 30) -> JSON:
        current = self.objects.get((res.plural, namespace or self.namespace, name))
        if current is None:
            raise errors.NotFound(name)
        wanted = (patch.get("metadata") or {}).get("resourceVersion")
        if wanted and wanted != current["metadata"]["resourceVersion"]:
            raise errors.Conflict(name)
        self.writes.append(("patch", res.plural, copy.deepcopy(patch)))
        return self.put(res, _merged(current, patch))

    def replace(self, res: Resource, body: JSON, *, sub: str | None = None, timeout: float = 30) -> JSON:
        meta = body["metadata"]
        current = self.objects.get((res.plural, meta["namespace"], meta["name"]))
        if current is None:
            raise errors.NotFound(meta["name"])
        if meta.get("resourceVersion") != current["metadata"]["resourceVersion"]:
            raise errors.Conflict(meta["name"])
        if meta.get("uid", current["metadata"].get("uid")) != current["metadata"].get("uid"):
            raise errors.Conflict(meta["name"])  # the API server's uid precondition
        self.writes.append(("replace" + (f"/{sub}" if sub else ""), res.plural, copy.deepcopy(body)))
        if sub == "status":  # as the API server does: all but the status is kept as stored
            body = {**copy.deepcopy(current), "status": copy.deepcopy(body.get("status"))}
        return self.put(res, body)

    def create(self, res: Resource, body: JSON, *, namespace: str | None = None, timeout: float = 30) -> JSON:
        self.writes.append(("create", res.plural, copy.deepcopy(body)))
        if res is EVENTS:
            return body
        body = copy.deepcopy(body)
        body["metadata"]["namespace"] = namespace or self.namespace
        return self.put(res, body)

    def delete(self, res: Resource, name: str, *, namespace: str | None = None,
               preconditions: JSON | None = None) -> None:
        self.writes.append(("delete", res.plural, {"name": name}))
        self.objects.pop((res.plural, namespace or self.namespace, name), None)

    def events(self) -> list[dict[str, Any]]:
        return [body for verb, plural, body in self.writes if verb == "create" and plural == EVENTS.plural]

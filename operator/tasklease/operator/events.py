"""Posting a Kubernetes Event on a Task: what `kubectl describe task` and `tasklease describe` show."""

from __future__ import annotations

import logging
from datetime import datetime

from tasklease.api import errors, models
from tasklease.kube import EVENTS, JSON, Kube
from tasklease.operator import metrics

log = logging.getLogger("tasklease.operator")


def post(kube: Kube, task: JSON, type_: str, reason: str, message: str, *, component: str,
         now: datetime | None = None) -> None:
    """One Event on `task`, stamped `now` (the poster's clock; the server's by default); a failure
    to post is logged, never raised (an Event is news, not state)."""
    meta = task["metadata"]
    stamp = (now or kube.now()).strftime("%Y-%m-%dT%H:%M:%SZ")
    event = {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {"apiVersion": f"{models.GROUP}/{models.VERSION}", "kind": models.KIND,
                           "name": meta["name"], "namespace": meta["namespace"], "uid": meta["uid"],
                           "resourceVersion": meta["resourceVersion"]},
        "reason": reason, "message": message[:1024], "type": type_,
        "source": {"component": component}, "reportingComponent": component,
        "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
    }
    try:
        kube.create(EVENTS, event, namespace=meta["namespace"])
        metrics.EVENTS_POSTED.inc()
    except errors.TaskleaseError as exc:
        log.warning("could not post event %s on %s/%s: %s", reason, meta["namespace"], meta["name"], exc)

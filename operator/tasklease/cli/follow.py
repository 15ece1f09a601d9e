"""List, then watch, across one namespace or all, resuming where the stream ended.

For the CLI's views (`list --watch`, `top`), which may span every namespace: a relist after
410 Gone reports the listed objects again as ADDED (a view redraws; it needs no diff).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from tasklease.api import errors
from tasklease.kube import JSON, Kube, Resource

log = logging.getLogger(__name__)

OnEvent = Callable[[str, JSON], None]
_RETRY_S = 1.0


def follow(kube: Kube, resource: Resource, *, namespace: str | None, on_event: OnEvent,
           label_selector: str = "", field_selector: str = "", stop: threading.Event | None = None,
           on_listed: Callable[[], None] | None = None, skip_list: str = "") -> None:
    """Deliver ("ADDED", obj) for each listed object, then every watch event, until `stop`.
    `namespace` None: all namespaces. `skip_list`: a resourceVersion to watch from at once."""
    stop = stop or threading.Event()
    version = skip_list
    while not stop.is_set():
        try:
            if not version:
                listed = kube.list(resource, namespace=namespace, all_namespaces=namespace is None,
                                   label_selector=label_selector, field_selector=field_selector)
                for obj in listed.get("items", []):
                    on_event("ADDED", obj)
                version = listed["metadata"]["resourceVersion"]
                if on_listed is not None:
                    on_listed()
            for event in kube.watch(resource, namespace=namespace, resource_version=version,
                                    label_selector=label_selector, field_selector=field_selector):
                obj = event["object"]
                if event["type"] == "ERROR":
                    raise errors.Gone(str(obj.get("message", "")))
                version = obj["metadata"]["resourceVersion"]
                if event["type"] != "BOOKMARK":
                    on_event(event["type"], obj)
                if stop.is_set():
                    return
        except errors.Gone:
            version = ""
        except (errors.Unreachable, errors.ServerError) as exc:
            log.warning("watch of %s interrupted (%s); resuming", resource.plural, exc)
            stop.wait(_RETRY_S)

"""Instant cancel: a held task's holder hears of `spec.cancel` or the Task's deletion at once.

Without this the holder learns it at its next renewal (a third of the lease duration).
One watch per (API client, namespace, queue) serves every task an agent process holds in
that queue: a claim registers its task, the end of the attempt unregisters it, and the
watch ends with the last registration. No polling: the API server pushes the change.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from tasklease.api import errors, models
from tasklease.kube import JSON, TASKS, Kube

log = logging.getLogger(__name__)

OnCancel = Callable[[str], None]
_RETRY_S = 1.0
_WATCH_TIMEOUT_S = 60  # a watch with nothing left to follow ends within this
_REMEMBER = 1024  # cancelled or deleted uids kept for a claim registering just after the news


class _QueueFollower:
    def __init__(self, kube: Kube, namespace: str, queue: str) -> None:
        self.kube, self.namespace, self.queue = kube, namespace, queue
        self.watchers: dict[str, tuple[str, OnCancel]] = {}  # name → (uid, callback)
        self.ended: OrderedDict[str, str] = OrderedDict()  # uid → why, newest last
        self.thread = threading.Thread(target=self._run, name=f"cancel-watch-{queue}", daemon=True)

    @property
    def key(self) -> tuple[int, str, str]:
        return (id(self.kube), self.namespace, self.queue)

    def _run(self) -> None:
        # Open tasks only, as the agents' own watch: a task that leaves it arrives as DELETED.
        selector = ",".join([f"spec.queue={self.queue}", *(f"status.phase!={p}" for p in models.TERMINAL_PHASES)])
        version = ""
        while True:
            try:
                if not version:
                    listed = self.kube.list(TASKS, namespace=self.namespace, field_selector=selector)
                    for obj in listed.get("items", []):
                        self._seen("ADDED", obj)
                    version = listed["metadata"]["resourceVersion"]
                for event in self.kube.watch(TASKS, namespace=self.namespace, resource_version=version,
                                             field_selector=selector, timeout_s=_WATCH_TIMEOUT_S):
                    obj = event["object"]
                    if event["type"] == "ERROR":
                        raise errors.Gone(str(obj.get("message", "")))
                    version = obj["metadata"]["resourceVersion"]
                    if event["type"] != "BOOKMARK":
                        self._seen(event["type"], obj)
                    if self._idle():
                        return
            except errors.Gone:
                version = ""
            except errors.TaskleaseError as exc:
                log.warning("cancel watch of queue %s interrupted (%s); resuming", self.queue, exc)
                threading.Event().wait(_RETRY_S)
            if self._idle():
                return


    def _idle(self) -> bool:
        """True (and forgotten) when nobody follows a task here any more."""
        with _lock:
            if self.watchers:
                return False
            if _followers.get(self.key) is self:
                del _followers[self.key]
            return True


    def _seen(self, kind: str, obj: JSON) -> None:
        meta: dict[str, Any] = obj["metadata"]
        if kind == "DELETED":
            why = f"task {meta['namespace']}/{meta['name']} was deleted or has finished"
        elif (obj.get("spec") or {}).get("cancel"):
            why = f"task {meta['namespace']}/{meta['name']} was cancelled"
        else:
            return
        with _lock:
            self.ended[meta["uid"]] = why
            while len(self.ended) > _REMEMBER:
                self.ended.popitem(last=False)
            uid, callback = self.watchers.get(meta["name"], ("", None))
            if callback is None or uid != meta["uid"]:
                return
            del self.watchers[meta["name"]]
        callback(why)


_followers: dict[tuple[int, str, str], _QueueFollower] = {}
_lock = threading.Lock()


class Following:
    """A registration: `close()` when the attempt is over (idempotent)."""

    def __init__(self, key: tuple[int, str, str], name: str, uid: str) -> None:
        self._key, self._name, self._uid = key, name, uid

    def close(self) -> None:
        with _lock:
            follower = _followers.get(self._key)
            if follower is not None and follower.watchers.get(self._name, ("",))[0] == self._uid:
                del follower.watchers[self._name]


def follow(kube: Kube, *, namespace: str, queue: str, name: str, uid: str, on_cancel: OnCancel) -> Following:
    """Call `on_cancel(why)` once if Task `namespace/name` (this `uid`) is cancelled or deleted."""
    key = (id(kube), namespace, queue)
    with _lock:
        follower = _followers.get(key)
        fresh = follower is None
        if follower is None:
            follower = _followers[key] = _QueueFollower(kube, namespace, queue)
        why = follower.ended.get(uid)
        if why is None:
            follower.watchers[name] = (uid, on_cancel)
    if fresh:
        follower.thread.start()
    if why is not None:
        on_cancel(why)
    return Following(key, name, uid)

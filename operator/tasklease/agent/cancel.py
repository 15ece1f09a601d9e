"""Instant cancel: a held task's holder hears of `spec.cancel` or the Task's deletion at once.

So it does of its attempt ended by the operator (an attempt timeout, an expiry), which the
Task's status shows.

Without this the holder learns it at its next renewal (a third of the lease duration).
One watch per (API client, namespace, queue) serves every task an agent process holds in
that queue: a claim registers its task, the end of the attempt unregisters it. While the
agent watches the queue to claim from it (`share`), that same Task watch serves; otherwise
the follower starts its own, which stops with the last registration. No polling: the API
server pushes the change.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from tasklease.api import errors
from tasklease.kube import JSON, TASKS, Kube
from tasklease.kube.watching import Listener, Reflector
from tasklease.agent.discovery import task_selector

log = logging.getLogger(__name__)

OnCancel = Callable[[str], None]
Key = tuple[int, str, str]  # (id of the API client, namespace, queue)
_WATCH_TIMEOUT_S = 60  # a stopped watch's stream ends within this
_REMEMBER = 1024  # cancelled or deleted uids (both final) kept for a claim registering just after the news

_SYNC_S = 30.0  # how long a late check waits for its queue's watch to list

_lock = threading.Lock()


class _QueueFollower:
    def __init__(self, kube: Kube, key: Key, reflector: Reflector | None = None) -> None:
        self.key = key
        self.kube = kube
        self.watchers: dict[str, tuple[str, int, OnCancel]] = {}  # name → (uid, epoch, callback)
        self.ended: OrderedDict[str, str] = OrderedDict()  # uid → why, newest last
        # Open tasks only, as the agents' own watch: a task that leaves it arrives as DELETED.
        # Only identities are kept: the events carry what a cancel needs.
        self.reflector = reflector or Reflector(
            kube, TASKS, namespace=key[1], field_selector=task_selector(key[2]), listener=self.seen,
            watch_timeout_s=_WATCH_TIMEOUT_S, keep_objects=False)

    def seen(self, kind: str, obj: JSON) -> None:
        meta: dict[str, Any] = obj["metadata"]
        if kind == "DELETED":
            with _lock:
                followed = meta["name"] in self.watchers
            # Every task of the queue leaves the watch when it finishes: only one we hold is
            # worth a request. One registering later is checked by `_verify_if_absent`.
            if followed:
                self.verify(meta["name"], meta["uid"])
        elif (obj.get("spec") or {}).get("cancel"):
            self._end(meta["name"], meta["uid"], f"task {meta['namespace']}/{meta['name']} was cancelled")
        else:
            self._attempt_ended(meta["name"], meta["uid"], obj.get("status") or {})

    def _attempt_ended(self, name: str, uid: str, status: JSON) -> None:
        """Someone else ended the attempt we follow. Not remembered like a cancel: the task
        goes on, and a later claim of it is another attempt."""
        with _lock:
            found, epoch, callback = self.watchers.get(name, ("", 0, None))
            why = attempt_over(status, epoch) if callback is not None and found == uid else None
            if why is None or callback is None:
                return
            del self.watchers[name]
        callback(f"task {self.key[1]}/{name}: {why}")

    def verify(self, name: str, uid: str) -> None:
        """The task left (or was never seen by) the watch: ask the API server why. Leaving the
        selector is not the end by itself, since a finished task can be retried; only a
        deletion or a cancel is final, so only those are remembered for a late claim."""
        try:
            live = self.kube.get_or_none(TASKS, name, namespace=self.key[1]) or {}
        except errors.TaskleaseError as exc:
            # Only a shortcut: a holder whose task is gone still learns it at its next renewal.
            log.warning("could not check why task %s/%s left the watch (%s); its holder, if any, learns it "
                        "at its next renewal", self.key[1], name, exc)
            return
        if (live.get("metadata") or {}).get("uid") != uid:
            self._end(name, uid, f"task {self.key[1]}/{name} was deleted")
        elif (live.get("spec") or {}).get("cancel"):
            self._end(name, uid, f"task {self.key[1]}/{name} was cancelled")
        else:  # finished meanwhile: by someone else (a last attempt timed out), or by its holder
            self._attempt_ended(name, uid, live.get("status") or {})

    def _end(self, name: str, uid: str, why: str) -> None:
        with _lock:
            self.ended[uid] = why
            while len(self.ended) > _REMEMBER:
                self.ended.popitem(last=False)
            found, _, callback = self.watchers.get(name, ("", 0, None))
            if callback is None or found != uid:
                return
            del self.watchers[name]
        callback(why)


_followers: dict[Key, _QueueFollower] = {}  # with a watch of their own
_shared: dict[Key, _QueueFollower] = {}  # served by an agent's QueueView


class Following:
    """A registration: `close()` when the attempt is over (idempotent)."""

    def __init__(self, key: Key, name: str, uid: str) -> None:
        self._key, self._name, self._uid = key, name, uid
        self._closed = False

    def close(self) -> None:
        with _lock:
            if self._closed:  # a later claim of the same task (same name and uid) may be followed now
                return
            self._closed = True
            for registry in (_shared, _followers):
                follower = registry.get(self._key)
                if follower is None or follower.watchers.get(self._name, ("",))[0] != self._uid:
                    continue
                del follower.watchers[self._name]
                if registry is _followers and not follower.watchers:  # the last one: stop watching
                    del _followers[self._key]
                    follower.reflector.stop()
                return


def share(kube: Kube, *, namespace: str, queue: str, tasks: Reflector,
          listeners: list[Listener]) -> Callable[[], None]:
    """Follow the claims of `queue` from `tasks`, an agent's running watch of the queue's open
    Tasks (the same selector), instead of opening one more per claim. `listeners` are the ones
    that watch calls. Returns the call to make before that watch stops: tasks still held
    then go to a follower with a watch of its own."""
    key = (id(kube), namespace, queue)
    follower = _QueueFollower(kube, key, reflector=tasks)
    listeners.append(follower.seen)
    with _lock:
        _shared[key] = follower

    def unshare() -> None:
        with _lock:
            if _shared.get(key) is follower:
                del _shared[key]
            left = dict(follower.watchers)
            follower.watchers.clear()
        for name, (uid, epoch, callback) in left.items():
            follow(kube, namespace=namespace, queue=queue, name=name, uid=uid, on_cancel=callback, epoch=epoch)
    return unshare


def follow(kube: Kube, *, namespace: str, queue: str, name: str, uid: str, on_cancel: OnCancel,
           epoch: int = 0) -> Following:
    """Call `on_cancel(why)` once if Task `namespace/name` (this `uid`) is cancelled or deleted,
    or (given its `epoch`) its status shows that attempt ended by someone else."""
    key = (id(kube), namespace, queue)
    with _lock:
        follower = _shared.get(key) or _followers.get(key)
        fresh = follower is None
        if follower is None:
            follower = _followers[key] = _QueueFollower(kube, key)
        why = follower.ended.get(uid)
        if why is None:
            follower.watchers[name] = (uid, epoch, on_cancel)
    if why is not None:
        on_cancel(why)
        return Following(key, name, uid)
    if fresh:
        follower.reflector.start()
    if follower.reflector.synced.is_set():
        _verify_if_absent(follower, name, uid)
    else:  # never block the claim: check once the first list is in
        threading.Thread(target=_after_sync, args=(follower, name, uid), name=f"follow-{name}", daemon=True).start()
    return Following(key, name, uid)


def _after_sync(follower: _QueueFollower, name: str, uid: str) -> None:
    if follower.reflector.synced.wait(_SYNC_S):
        _verify_if_absent(follower, name, uid)


def _verify_if_absent(follower: _QueueFollower, name: str, uid: str) -> None:
    """A cancel or deletion between the claim and the watch's first list sends no event."""
    with _lock:
        followed = follower.watchers.get(name, ("",))[0] == uid
    if followed and name not in follower.reflector.store:
        follower.verify(name, uid)


# The endings a holder writes itself: it knows of them already.
_HOLDER_ENDINGS = ("Succeeded", "Failed", "Released")


def attempt_over(status: JSON, epoch: int) -> str | None:
    """Why attempt `epoch` is over by someone else's doing, as the Task's status (the operator's
    projection of the Lease) tells it; None when it does not say so. A status from before the
    claim shows older attempts only."""
    if epoch <= 0:
        return None
    for attempt in status.get("history") or []:
        outcome = attempt.get("outcome") or ""
        if attempt.get("attempt") == epoch and outcome and outcome not in _HOLDER_ENDINGS:
            return f"attempt {epoch} ended {outcome}: {attempt.get('message') or outcome}"
    later = int(status.get("attempt") or 0)
    return f"attempt {later} started after attempt {epoch}" if later > epoch else None

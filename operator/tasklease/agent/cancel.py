"""Instant cancel: a held task's holder hears of `spec.cancel` or the Task's deletion at once.

So it does of its attempt ended by the operator (an attempt timeout, an expiry), which the
Task's status shows.

Without this the holder learns it at its next renewal (a third of the lease duration).
An agent's `Followers` keep one watch per (namespace, queue) for every task the agent holds
in that queue: a claim registers its task, the end of the attempt unregisters it. While the
agent watches the queue to claim from it (`share`), that same Task watch serves; otherwise
the follower starts its own, which stops with the last registration. No polling: the API
server pushes the change. Nothing is shared between agents: each has its own `Followers`.
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
from tasklease.agent.discovery import queue_selector, task_selector
from tasklease.agent.taskwatch import TaskWatches

log = logging.getLogger(__name__)

OnCancel = Callable[[str], None]
Key = tuple[str, str]  # (namespace, queue)
_WATCH_TIMEOUT_S = 60  # a stopped watch's stream ends within this
_REMEMBER = 1024  # cancelled or deleted uids (both final) kept for a claim registering just after the news

_SYNC_S = 30.0  # how long a late check waits for its queue's watch to list


class _QueueFollower:
    def __init__(self, kube: Kube, key: Key, reflector: TaskWatches | None = None,
                 lock: threading.Lock | None = None) -> None:
        """`lock`: the one of the `Followers` this belongs to (it guards `watchers` and `ended`)."""
        self.key = key
        self.kube = kube
        self._lock = lock or threading.Lock()
        self.watchers: dict[str, tuple[str, int, OnCancel]] = {}  # name → (uid, epoch, callback)
        self.ended: OrderedDict[str, str] = OrderedDict()  # uid → why, newest last
        # Open tasks only, as the agents' own watch: a task that leaves it arrives as DELETED.
        # Only identities are kept: the events carry what a cancel needs.
        # A task of a shard the agent's own watches leave out is checked when followed (`verify`).
        self.own: Reflector | None = None
        self.reflector: Reflector | TaskWatches
        if reflector is None:
            self.reflector = self.own = Reflector(
                kube, TASKS, namespace=key[0], field_selector=task_selector(key[1]),
                watch_field_selector=queue_selector(key[1]), listener=self.seen,
                watch_timeout_s=_WATCH_TIMEOUT_S, keep_objects=False)
        else:
            self.reflector = reflector

    def seen(self, kind: str, obj: JSON) -> None:
        meta: dict[str, Any] = obj["metadata"]
        if kind == "DELETED":
            with self._lock:
                uid = self.watchers.get(meta["name"], ("",))[0]
            # Every task of the queue leaves the watch when it finishes: only one we hold is
            # worth a request (the one we follow: a relist's deletion carries its name only).
            # One registering later is checked by `_verify_if_absent`.
            if uid:
                self.verify(meta["name"], uid)
        elif (obj.get("spec") or {}).get("cancel"):
            self._end(meta["name"], meta["uid"], f"task {meta['namespace']}/{meta['name']} was cancelled")
        else:
            self._attempt_ended(meta["name"], meta["uid"], obj.get("status") or {})

    def _attempt_ended(self, name: str, uid: str, status: JSON) -> None:
        """Someone else ended the attempt we follow. Not remembered like a cancel: the task
        goes on, and a later claim of it is another attempt."""
        with self._lock:
            found, epoch, callback = self.watchers.get(name, ("", 0, None))
            why = attempt_over(status, epoch) if callback is not None and found == uid else None
            if why is None or callback is None:
                return
            del self.watchers[name]
        callback(f"task {self.key[0]}/{name}: {why}")

    def verify(self, name: str, uid: str) -> None:
        """The task left (or was never seen by) the watch: ask the API server why. Leaving the
        selector is not the end by itself, since a finished task can be retried; only a
        deletion or a cancel is final, so only those are remembered for a late claim."""
        try:
            live = self.kube.get_or_none(TASKS, name, namespace=self.key[0]) or {}
        except errors.TaskleaseError as exc:
            # Only a shortcut: a holder whose task is gone still learns it at its next renewal.
            log.warning("could not check why task %s/%s left the watch (%s); its holder, if any, learns it "
                        "at its next renewal", self.key[0], name, exc)
            return
        if (live.get("metadata") or {}).get("uid") != uid:
            self._end(name, uid, f"task {self.key[0]}/{name} was deleted")
        elif (live.get("spec") or {}).get("cancel"):
            self._end(name, uid, f"task {self.key[0]}/{name} was cancelled")
        else:  # finished meanwhile: by someone else (a last attempt timed out), or by its holder
            self._attempt_ended(name, uid, live.get("status") or {})

    def _end(self, name: str, uid: str, why: str) -> None:
        with self._lock:
            self.ended[uid] = why
            while len(self.ended) > _REMEMBER:
                self.ended.popitem(last=False)
            found, _, callback = self.watchers.get(name, ("", 0, None))
            if callback is None or found != uid:
                return
            del self.watchers[name]
        callback(why)


class Following:
    """A registration: `close()` when the attempt is over (idempotent)."""

    def __init__(self, followers: Followers, key: Key, name: str, uid: str) -> None:
        self._followers, self._key, self._name, self._uid = followers, key, name, uid
        self._closed = False

    def close(self) -> None:
        self._followers._unregister(self)


class Followers:
    """The follows of one agent's claims (one API client): at most one Task watch per queue."""

    def __init__(self, kube: Kube) -> None:
        self._kube = kube
        self._lock = threading.Lock()
        self._own: dict[Key, _QueueFollower] = {}  # with a watch of their own
        self._shared: dict[Key, _QueueFollower] = {}  # served by the agent's QueueView

    def share(self, *, namespace: str, queue: str, tasks: TaskWatches,
              listeners: list[Listener]) -> Callable[[], None]:
        """Follow the claims of `queue` from `tasks`, the agent's running watch of the queue's open
        Tasks (the same selector), instead of opening one more per claim. `listeners` are the ones
        that watch calls. Returns the call to make before that watch stops: tasks still held
        then go to a follower with a watch of its own."""
        key = (namespace, queue)
        follower = _QueueFollower(self._kube, key, reflector=tasks, lock=self._lock)
        listeners.append(follower.seen)
        with self._lock:
            self._shared[key] = follower

        def unshare() -> None:
            with self._lock:
                if self._shared.get(key) is follower:
                    del self._shared[key]
                left = dict(follower.watchers)
                follower.watchers.clear()
            for name, (uid, epoch, callback) in left.items():
                self.follow(namespace=namespace, queue=queue, name=name, uid=uid, on_cancel=callback, epoch=epoch)
        return unshare

    def follow(self, *, namespace: str, queue: str, name: str, uid: str, on_cancel: OnCancel,
               epoch: int = 0) -> Following:
        """Call `on_cancel(why)` once if Task `namespace/name` (this `uid`) is cancelled or deleted
        (at once, in this thread, if that is known already), or (given its `epoch`) its status
        shows that attempt ended by someone else."""
        key = (namespace, queue)
        with self._lock:
            follower = self._shared.get(key) or self._own.get(key)
            fresh = follower is None
            if follower is None:
                follower = self._own[key] = _QueueFollower(self._kube, key, lock=self._lock)
            why = follower.ended.get(uid)
            if why is None:
                follower.watchers[name] = (uid, epoch, on_cancel)
        following = Following(self, key, name, uid)
        if why is not None:
            on_cancel(why)
            return following
        if fresh and follower.own is not None:
            follower.own.start()
        if follower.reflector.synced.is_set():
            self._verify_if_absent(follower, name, uid)
        else:  # never block the claim: check once the first list is in
            threading.Thread(target=self._after_sync, args=(follower, name, uid), name=f"follow-{name}",
                             daemon=True).start()
        return following

    def close(self) -> None:
        """Stop every watch of our own; the follows still registered hear nothing more."""
        with self._lock:
            own, self._own = list(self._own.values()), {}
            for follower in (*own, *self._shared.values()):
                follower.watchers.clear()
        for follower in own:
            follower.reflector.stop()

    def _unregister(self, following: Following) -> None:
        with self._lock:
            if following._closed:  # a later claim of the same task (same name and uid) may be followed now
                return
            following._closed = True
            key, name, uid = following._key, following._name, following._uid
            for registry in (self._shared, self._own):
                follower = registry.get(key)
                if follower is None or follower.watchers.get(name, ("",))[0] != uid:
                    continue
                del follower.watchers[name]
                stop = registry is self._own and not follower.watchers  # the last one: stop watching
                if stop:
                    del self._own[key]
                break
            else:
                return
        if stop:
            follower.reflector.stop()

    def _after_sync(self, follower: _QueueFollower, name: str, uid: str) -> None:
        if follower.reflector.synced.wait(_SYNC_S):
            self._verify_if_absent(follower, name, uid)

    def _verify_if_absent(self, follower: _QueueFollower, name: str, uid: str) -> None:
        """A cancel or deletion between the claim and the watch's first list sends no event."""
        with self._lock:
            followed = follower.watchers.get(name, ("",))[0] == uid
        if followed and not follower.reflector.has(name):
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

"""List-then-watch into a local cache, resuming where it left off (a small client-go Reflector).

A restarted watch asks for the last resourceVersion it saw, so nothing that happened
while it reconnected is missed; when the server no longer has that version (410 Gone)
it lists again and reports what disappeared meanwhile as deletions. Lists are paginated
(`limit`/`continue`): a large queue never arrives as one huge answer; one that outlives
its snapshot goes on at the server's current version, and a page that fails is asked for
again (see `_relist`). Failures are retried with capped exponential backoff
(`api.retry.Backoff`), which starts over once a list or watch has run for a while; only a 410
relists, and a permanent error (no rights, no CRD) stops the thread with `error` set, logged
once.

`watch_list=True` lists as a streaming list instead (`sendInitialEvents`, on by default since
Kubernetes 1.32): the selected objects arrive as the first events of a watch, served from
the API server's watch cache in one response. A paginated list is a request per page, each
read from etcd when the cache cannot serve it; many agents listing a deep queue at once make
thousands. Its response asks for a longer timeout than a watch (`LIST_TIMEOUT_S`). A server
that refuses it gets a paginated list, and so does, that time, a streaming list the server
ends before its last object (an API server ends the watch of a reader that falls behind, and
a list could still outlast its timeout).

The watch that follows a streaming list is opened just before it, from the version the list
then starts at (`_Pinned`): what changes while the list is read waits in it. A deep queue
that many agents list at once takes minutes, and by then the watch cache may hold none of
the events since the list's own version (it keeps a few minutes of them, or far fewer once
it has shrunk after a burst of writes): a watch asked from that version would be answered
410, and everything listed again.
"""

from __future__ import annotations

import bisect
import json
import logging
import threading
import time
from collections.abc import Callable, Collection, Generator, Iterable, Iterator

from tasklease.api import errors
from tasklease.api.retry import Backoff, transient
from tasklease.kube import JSON, Kube, Resource
from tasklease.kube.client import INITIAL_EVENTS_END, Hangup

# The timeout of a streaming list's response, which the watch then goes on in: a deep queue
# listed by many agents at once takes minutes, longer than a watch's usual timeout.
LIST_TIMEOUT_S = 1800
# A list or watch that ran this long before it failed had recovered from any earlier failure:
# its retry waits the shortest delay again (an API server restarted twice is two outages).
_HEALTHY_S = 10.0
_RETRY_BASE_S, _RETRY_CAP_S = 0.5, 30.0  # the first and the longest wait before a retry
# Objects whose changes a watch opened before a list keeps while the list is read (`_Pinned`):
# at a few kilobytes each, a busy queue listed for minutes would otherwise cost an agent more
# than its whole index.
_PINNED_MAX = 4096
_PINNED_GONE_MAX = 65536  # of those that left a narrowed watch's selection (a name and version each)

log = logging.getLogger(__name__)

Listener = Callable[[str, JSON], None]


class Reflector:
    """Keeps `store` (name → object) equal to the selected objects; calls `listener(type, obj)`.

    `keep_objects=False`: the store keeps only each object's (uid, resourceVersion), for a
    listener that keeps its own, smaller picture (a dict per object would cost more than the
    listener's whole record of it); a deletion found by a relist is then delivered with that
    metadata only. `known`: the names the listener keeps itself, for one that keeps every
    object's name: the store then stays empty, and a deletion found by a relist carries the
    name alone; what it answers as a list starts is what that list is compared with (a copy,
    from a listener that also learns names elsewhere: one learned during the list, which the
    list may not show, is no deletion). `knows(name)`: whether `name` is in `known()`, answered
    without making it (a narrowed watch asks at every event, a relist for each name it did not
    bring again). `namespace=None` watches every namespace; the store is then keyed by
    `namespace/name`. `since`: a resourceVersion to watch from at once, for a
    caller that has just listed (no first list; `synced` waits for a relist). `watch_list`: list
    as a streaming list (see the module), `pages` counting every `page_size` objects.
    `batch_s`: the watch after the list reads a busy stream a batch at a time, each event up
    to `batch_s` late (`Kube.watch`); a list is read as fast as it comes. `delivered`: the
    version up to which the listener has been told everything selected, or "" while a list
    is under way: a watch started from it (`since`) misses nothing this one told.

    `watch_field_selector`: the watch that follows a list selects with it, a superset of
    `field_selector`, which the reflector then applies itself: an object that stops matching
    `field_selector` is delivered as DELETED, one that starts to as ADDED, and changes of
    objects outside it not at all. The API server sends an object that leaves a watch's
    selection as a DELETED of its previous content, copied and encoded again for each
    watcher; a MODIFIED is encoded once for all of them."""

    def __init__(self, kube: Kube, resource: Resource, *, namespace: str | None, listener: Listener,
                 label_selector: str = "", field_selector: str = "", watch_timeout_s: int = 300,
                 keep_objects: bool = True, known: Callable[[], Collection[str]] | None = None,
                 knows: Callable[[str], bool] | None = None, page_size: int = 500, since: str = "",
                 watch_list: bool = False, watch_field_selector: str = "", batch_s: float = 0.0) -> None:
        self.kube = kube
        self.resource = resource
        self.namespace = namespace
        self.listener = listener
        self.label_selector = label_selector
        self.field_selector = field_selector
        self.watch_field_selector = watch_field_selector or field_selector
        self._narrowed = _requirements(field_selector) if watch_field_selector else None
        self.watch_timeout_s = watch_timeout_s
        self.keep_objects = keep_objects
        self.known = known
        self._knows = knows
        self.page_size = page_size
        self.watch_list = watch_list
        self.batch_s = batch_s
        self.store: dict[str, JSON | tuple[str, str]] = {}
        self.synced = threading.Event()
        self.synced_at: float | None = None  # when `synced` was set (time.time()): a deep list's length shows here
        self.error: Exception | None = None  # the last failure, until the next success
        self.lists = 0  # full LISTs made: one at start, one more per 410 Gone
        self.watches = 0  # watch requests made: one more each time a stream ends
        self.pages = 0  # LIST pages received: a long first list shows its progress here
        self.resumed = 0  # lists that outlived their snapshot and went on at a newer version
        self.cut_short = 0  # streaming lists the API server ended before their last object
        self.retried = 0  # pages of a list asked for again after a transient failure
        self._stop = threading.Event()
        self._hangup = Hangup()  # `stop` ends a watch under way at once, not at its next event
        self._pinned: _Pinned | None = None  # the watch opened before a streaming list, until it is read
        self._rv = since
        self.delivered = since
        self._thread = threading.Thread(target=self._run, name=f"watch-{resource.plural}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._hangup.hang_up()
        pinned = self._pinned
        if pinned is not None:
            pinned.stop()

    @property
    def stopped(self) -> bool:
        """Its thread has ended: asked to, or stopped by a permanent error (then in `error`)."""
        return self._thread.ident is not None and not self._thread.is_alive()

    def _run(self) -> None:
        try:
            self._resume()
        finally:
            pinned = self._pinned
            if pinned is not None:  # stopped by a permanent error before it was read
                pinned.stop()

    def _resume(self) -> None:
        backoff = Backoff(base_s=_RETRY_BASE_S, cap_s=_RETRY_CAP_S, healthy_s=_HEALTHY_S)
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self._list_and_watch()
                backoff.reset()  # a stream that ended normally: resume at once
            except errors.Gone:
                self._rv = ""
            except errors.TaskleaseError as exc:
                self.error = exc
                if not transient(exc):
                    log.error("watch of %s stopped: %s", self.resource.plural, exc)
                    return
                delay = backoff.failed(time.monotonic() - started)
                log.warning("watch of %s interrupted (%s); resuming in %.1fs", self.resource.plural, exc, delay)
                self._stop.wait(delay)
            except Exception as exc:  # noqa: BLE001 - a dead watch thread would freeze the agent's view
                # Something we could not read (a bug, a malformed event): start over.
                self.error = exc
                self._rv = ""
                delay = backoff.failed(time.monotonic() - started)
                log.error("watch of %s failed: %s; resuming in %.1fs", self.resource.plural, exc, delay)
                self._stop.wait(delay)

    def _list_and_watch(self) -> None:
        """A list when there is no version to resume from (a streaming one if it can), then the
        watch, until its stream ends."""
        if not self._rv:
            self.delivered = ""  # until the list ends: see `_listed`
        if not self._rv and self.watch_list:
            try:
                if self._stream() or self._stop.is_set():
                    return  # listed: the watch opened before the list goes on (next `_watch`)
                # Cut short before its list ended: the API server ended the watch of a reader
                # that fell behind, or even `LIST_TIMEOUT_S` came first. Streamed again it could
                # be cut again: this time it is listed in pages, as client-go does, and the
                # watch opened before the streaming list goes on after it.
                self.cut_short += 1
                log.info("the streaming list of %s was cut short by the API server; listing in pages",
                         self.resource.plural)
            except errors.Invalid as exc:
                log.info("the API server does not stream lists of %s (%s); listing in pages",
                         self.resource.plural, exc)
                self.watch_list = False
            if self._stop.is_set():
                return
        if not self._rv:
            self._relist()
        if not self._stop.is_set():
            self._watch()

    def has(self, name: str) -> bool:
        """Whether the object `name` is in the picture (in `known`, when the listener keeps it)."""
        if self._knows is not None:
            return self._knows(name)
        return name in (self.known() if self.known is not None else self.store)

    def _relist(self) -> None:
        unlisted = self._unlisted()
        since, start = "", ""
        retry = Backoff(base_s=_RETRY_BASE_S, cap_s=_RETRY_CAP_S)
        while True:
            try:
                for page in self.kube.list_pages(self.resource, namespace=self.namespace,
                                                 all_namespaces=self.namespace is None, limit=self.page_size,
                                                 label_selector=self.label_selector,
                                                 field_selector=self.field_selector, start=start, stream=True):
                    for obj in page.get("items", []):
                        name = self._name(obj)
                        if unlisted is not None:
                            unlisted.strike(name)
                        self._keep(name, obj)
                        self._deliver("ADDED", obj)
                    since = since or page["metadata"]["resourceVersion"]
                    start = page["metadata"].get("continue") or start
                    self.pages += 1
                    retry.reset()
                break
            except errors.Gone as exc:
                if not exc.resume:
                    raise
                # The list outlived its snapshot (etcd compacts every few minutes; a deep queue
                # that many agents list at once takes longer). Starting over could fail the same
                # way for ever: the rest is listed at the server's current version instead, and
                # the watch starts from the first page's version, so it brings every change since
                # to what was listed before as after (older news for an object listed later is
                # followed by the news it was listed with).
                log.info("the list of %s outlived its snapshot after %d pages; listing the rest as they are now",
                         self.resource.plural, self.pages)
                self.resumed += 1
                start = exc.resume
            except errors.TaskleaseError as exc:
                if not transient(exc):
                    raise
                # A page that failed (one that timed out on a loaded API server) is asked for
                # again, from the same snapshot: a list started over would read everything
                # listed so far again, and on a deep queue that many agents list at once add
                # to the load that failed it.
                self.error, self.retried = exc, self.retried + 1
                delay = retry.next()
                log.warning("a page of the list of %s failed after %d pages (%s); asking again in %.1fs",
                            self.resource.plural, self.pages, exc, delay)
                if self._stop.wait(delay):
                    return
        self._listed(unlisted, since)

    def _stream(self) -> bool:
        """A streaming list, the watch that follows it opened just before (`_Pinned`). Whether
        the list ended: until the bookmark that ends it, a broken stream is a list to start
        again (`_rv` stays empty), while the watch opened before it goes on."""
        unlisted = self._unlisted()
        listed = 0
        version = self._pin()
        self.watches += 1
        for event in self.kube.watch(self.resource, namespace=self.namespace, resource_version=version,
                                     label_selector=self.label_selector, field_selector=self.field_selector,
                                     timeout_s=max(self.watch_timeout_s, LIST_TIMEOUT_S), initial_events=True,
                                     hangup=self._hangup):
            if self._stop.is_set():
                return False
            kind, obj = event["type"], event["object"]
            if kind == "ERROR":
                self._event(kind, obj)
            elif kind == "BOOKMARK":
                if (obj["metadata"].get("annotations") or {}).get(INITIAL_EVENTS_END) == "true":
                    self.pages += 1  # the last, part of a page
                    self._listed(unlisted, obj["metadata"]["resourceVersion"])
                    return True  # the watch goes on in the one opened before (`_watch`)
            else:
                name = self._name(obj)
                if unlisted is not None:
                    unlisted.strike(name)
                self._keep(name, obj)
                self._deliver("ADDED", obj)
                listed += 1
                if listed % self.page_size == 0:
                    self.pages += 1
        return False

    def _pin(self) -> str:
        """Open the watch that follows a list, from the API server's current version (read by
        a one-object list, unselected: a server that filters a selector itself could read far
        for one match), and return that version: the list is read as of it or later."""
        version = str(self.kube.list(self.resource, namespace=self.namespace, all_namespaces=self.namespace is None,
                                     limit=1)["metadata"]["resourceVersion"])
        if self._pinned is not None:
            self._pinned.stop()
        self._pinned = _Pinned(self, version)
        self.watches += 1
        if self._stop.is_set():
            self._pinned.stop()
        return version

    def _unlisted(self) -> _Unlisted | None:
        """Before a list: what is in the picture (none on a first list), struck off as the list
        brings it again; what is left when the list ends was deleted meanwhile."""
        before = self.known() if self.known is not None else self.store
        return _Unlisted(before) if before else None

    def _listed(self, unlisted: _Unlisted | None, version: str) -> None:
        """A list has ended at `version`: what it did not bring again (`_unlisted`) is gone."""
        self.lists += 1
        for name in unlisted or ():
            if self.has(name):  # the store keeps nothing when the listener keeps the names
                self._deliver("DELETED", self._stored(name, self.store.pop(name, None)))
        self._rv = version
        # With a watch opened before the list, what changed while it was read is still to be
        # told, and not in the order of its versions (`_Pinned.events`): `_watch` says when.
        self.delivered = version if self._pinned is None else ""
        self.error = None
        if self._pinned is not None:
            self._pinned.listed(version)
        if self.synced_at is None:
            self.synced_at = time.time()
        self.synced.set()

    def _watch(self) -> None:
        pinned = self._pinned
        events: Iterator[JSON]
        if pinned is None:
            self.watches += 1
            events = self.kube.watch(self.resource, namespace=self.namespace, resource_version=self._rv,
                                     label_selector=self.label_selector, field_selector=self.watch_field_selector,
                                     timeout_s=self.watch_timeout_s, hangup=self._hangup, batch_s=self.batch_s)
        else:
            events = pinned.events(tell=self._take)
        try:
            for event in events:
                if self._stop.is_set():
                    return
                if pinned is None or pinned.caught_up:  # only now: another thread reads it meanwhile
                    self._take(event)
                else:
                    self._event(event["type"], event["object"])
        finally:
            if pinned is not None:
                pinned.stop()
                self._pinned = None

    def _take(self, event: JSON) -> None:
        """An event of the watch once everything before it is told."""
        if not self._stop.is_set():
            self._event(event["type"], event["object"])
            self.delivered = self._rv

    def _event(self, kind: str, obj: JSON) -> None:
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise errors.Gone(obj.get("message", "too old resource version"))
            raise errors.ServerError(obj.get("message", "watch error"))
        self._rv = obj["metadata"]["resourceVersion"]
        if kind == "BOOKMARK":
            return
        name = self._name(obj)
        if self._narrowed is not None:
            inside = kind != "DELETED" and _selects(self._narrowed, obj)
            if inside != self.has(name):
                kind = "ADDED" if inside else "DELETED"
            elif not inside:
                return  # a change of an object that is not in the picture
        if kind == "DELETED":
            self.store.pop(name, None)
        else:
            self._keep(name, obj)
        self._deliver(kind, obj)

    def _name(self, obj: JSON) -> str:
        meta = obj["metadata"]
        return str(meta["name"]) if self.namespace is not None else f"{meta.get('namespace')}/{meta['name']}"

    def _keep(self, name: str, obj: JSON) -> None:
        meta = obj["metadata"]
        if self.known is None:
            self.store[name] = obj if self.keep_objects else (meta.get("uid", ""), meta.get("resourceVersion", ""))

    def _stored(self, name: str, kept: JSON | tuple[str, str] | None) -> JSON:
        """The object `_keep` kept under `name`, or its metadata when it kept the identity (or nothing: its name)."""
        if isinstance(kept, dict):
            return kept
        namespace, _, short = name.rpartition("/") if self.namespace is None else (self.namespace, "", name)
        if kept is None:
            return {"metadata": {"name": short, "namespace": namespace}}
        uid, resource_version = kept
        return {"metadata": {"name": short, "namespace": namespace, "uid": uid, "resourceVersion": resource_version}}

    def _deliver(self, kind: str, obj: JSON) -> None:
        """One bad object (say, a hand-edited annotation) must not stop the stream. Once stopped,
        nothing more is delivered, not even the rest of a list under way."""
        if self._stop.is_set():
            return
        try:
            self.listener(kind, obj)
        except Exception:  # noqa: BLE001
            log.exception("skipping %s %s/%s: it could not be read", self.resource.plural,
                          obj.get("metadata", {}).get("namespace"), obj.get("metadata", {}).get("name"))


class _Pinned:
    """A watch opened before a list, whose events wait until the list has ended: then those that
    came while it was read are told, each object's last one only (the list showed it as of a
    version no older than the watch's first, and its last event is its newest state), and
    the rest as they come, until the watch ends. Its own thread reads it: the list's thread
    is busy with the list. Once the reflector's thread has told everything read so far, the
    reader tells each event itself (`events`' `tell`) while that thread waits for the end:
    relayed, every event would cost two threads a wake-up. What waits is one event per
    object changed: at most `_PINNED_MAX` whole, and `_PINNED_GONE_MAX` more of a narrowed
    watch's objects that left the list's selection (their name and version only: all a
    reflector tells of them is a DELETED). Beyond that the watch is given up, and the one
    after the list is asked for from the list's own version, as if there had been none. Once
    the list has ended, at most `_PINNED_MAX` events wait for the reflector to read them:
    the reader then reads no more (and an API server ends the watch of a reader that falls
    behind)."""

    def __init__(self, reflector: Reflector, version: str) -> None:
        self._changed = threading.Condition()
        self._narrowed = reflector._narrowed
        self._name, self._stored = reflector._name, reflector._stored  # its names, as the reflector's store keys
        self._plural = reflector.resource.plural
        self._waiting: dict[str, JSON] = {}  # while the list is read: name → last event
        self._gone: dict[str, tuple[str, str]] = {}  # → (uid, resourceVersion): left the selection
        self._version = ""  # of the last event that waits
        self._failed: JSON | None = None  # an ERROR event while the list is read
        self._events: list[JSON] = []  # once the list has ended, until `_tell` is set
        self._tell: Callable[[JSON], None] | None = None  # then this thread tells each event itself
        self._listed = False
        self._list_version = ""  # the version the list ended at
        self.caught_up = False  # what came while the list was read is told: the rest comes in order
        self._ended = False
        self._error: Exception | None = None
        self._hangup = Hangup()
        r = reflector
        watch = r.kube.watch(r.resource, namespace=r.namespace, resource_version=version,
                             label_selector=r.label_selector, field_selector=r.watch_field_selector,
                             timeout_s=max(r.watch_timeout_s, LIST_TIMEOUT_S), hangup=self._hangup,
                             batch_s=r.batch_s)
        threading.Thread(target=self._read, args=(watch,), name=f"watch-{r.resource.plural}-pinned",
                         daemon=True).start()

    def _read(self, watch: Generator[JSON, None, None]) -> None:
        try:
            try:
                for event in watch:
                    with self._changed:
                        # Only a listed watch not yet handed over keeps events, and only until they are taken.
                        while len(self._events) >= _PINNED_MAX and not self._hangup.hung_up:
                            self._changed.wait(1.0)
                        tell = self._tell
                        if tell is None and self._listed:
                            self._events.append(event)
                            if len(self._events) == 1:  # its reader waits only for an empty list
                                self._changed.notify_all()
                        elif tell is None and not self._wait(event):
                            log.info("too many objects changed while a list of %s was read; its watch starts "
                                     "after it", self._plural)
                            self._waiting.clear()
                            self._gone.clear()
                            self._version = ""
                            return
                    if tell is not None:
                        tell(event)  # outside the lock: the reflector's thread only waits for the end now
            finally:
                watch.close()
        except Exception as exc:  # noqa: BLE001 - raised where its events are read (`events`)
            self._error = exc
        finally:
            with self._changed:
                self._ended = True
                self._changed.notify_all()

    def _wait(self, event: JSON) -> bool:
        """Keep `event` until the list has ended, in place of the object's earlier one; False
        when too many objects wait."""
        if event["type"] == "ERROR":  # the last: the server ends the watch after it
            self._failed = event
            return True
        meta = event["object"]["metadata"]
        self._version = meta["resourceVersion"]
        if event["type"] == "BOOKMARK":
            return True
        key = self._name(event["object"])
        self._waiting.pop(key, None)  # its last event comes after every other that waits
        self._gone.pop(key, None)
        if self._narrowed is not None and (event["type"] == "DELETED" or not _selects(self._narrowed,
                                                                                      event["object"])):
            self._gone[key] = (str(meta.get("uid", "")), self._version)
        else:
            self._waiting[key] = event
        return len(self._waiting) <= _PINNED_MAX and len(self._gone) <= _PINNED_GONE_MAX

    def listed(self, version: str) -> None:
        """The list has ended, at `version`: what arrived until now came while it was read."""
        with self._changed:
            self._listed, self._list_version = True, version

    def events(self, tell: Callable[[JSON], None]) -> Iterator[JSON]:
        """Its events (see the class), then its failure, if it failed, raised. Once every event
        read so far is told, the rest go to `tell`, from the reader's thread, until the watch
        ends; a failure of `tell` ends it, and is raised here."""
        with self._changed:
            self._listed = True
            waited = list(self._waiting.values())
            waited += ({"type": "DELETED", "object": self._stored(name, kept)} for name, kept in self._gone.items())
            # The version of the last that waited, told or not, or else the list's: the
            # reflector has told everything up to it once this is read (`caught_up`).
            end = self._version or self._list_version
            caught_up = [{"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": end}}}] if end else []
            failed = [self._failed] if self._failed is not None else []
            self._waiting.clear()
            self._gone.clear()
        yield from waited
        self.caught_up = True
        yield from caught_up
        yield from failed
        while True:
            with self._changed:
                batch, self._events = self._events, []
                self._changed.notify_all()
                if not batch:  # all told, each before this thread came back here
                    self._tell = tell
                    while not self._ended:
                        self._changed.wait()
                    break
            yield from batch
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        self._hangup.hang_up()
        with self._changed:
            self._changed.notify_all()


class _Unlisted:
    """The names a picture held before a list, each struck off as the list brings it again. It
    refers to the names the picture holds, sorted, and keeps a byte per name: a set of them, or
    of the names listed, would take several times that while a deep queue is listed again
    (after a streaming list was cut short, or a 410)."""

    def __init__(self, names: Iterable[str]) -> None:
        self._names = sorted(names)
        self._struck = bytearray(len(self._names))

    def strike(self, name: str) -> None:
        at = bisect.bisect_left(self._names, name)
        if at < len(self._names) and self._names[at] == name:
            self._struck[at] = 1

    def __iter__(self) -> Iterator[str]:
        return (name for name, struck in zip(self._names, self._struck, strict=True) if not struck)


def _requirements(selector: str) -> list[tuple[list[str], bool, str]]:
    """A field selector's requirements, as (path, equal, value): `a.b=v`, `a.b==v`, `a.b!=v`."""
    out = []
    for term in filter(None, selector.split(",")):
        path, sign, value = term.partition("!=") if "!=" in term else term.partition("=")
        if not sign:
            raise ValueError(f"not a field selector requirement: {term!r}")
        out.append((path.split("."), sign == "=", value.removeprefix("=")))
    return out


def _selects(requirements: list[tuple[list[str], bool, str]], obj: JSON) -> bool:
    """Whether `obj` matches every requirement, as the API server judges a selectable field:
    an absent field is the empty string."""
    for path, equal, value in requirements:
        found: object = obj
        for key in path:
            found = found.get(key) if isinstance(found, dict) else None
        text = "" if found is None else found if isinstance(found, str) else json.dumps(found)
        if (text == value) != equal:
            return False
    return True

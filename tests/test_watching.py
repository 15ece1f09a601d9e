"""Discovery's watches against a real API server: a restarted watch misses nothing, and one
whose version the server no longer keeps (410 Gone) lists again."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from conftest import Cluster, make_task, wait_for
from tasklease.agent.discovery import queue_selector, task_selector
from tasklease.api import errors, models
from tasklease_dev.cluster import compact_etcd
from tasklease.kube import LEASES, JSON, TASKS, Kube, Resource, client
from tasklease.kube.watching import LIST_TIMEOUT_S, Reflector

# Watched straight from etcd on the local control plane (no watch cache, see dev/cluster.py).
PODTEMPLATES = Resource("", "v1", "podtemplates")


def lease(name: str, label: str) -> JSON:
    """A Lease body labelled `test=<label>`, the selector each test watches."""
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": name, "labels": {"test": label}}, "spec": {}}


class Seen(list[str]):
    """A listener that records each event as "KIND name" (watch threads append, the test reads)."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

    def __call__(self, kind: str, obj: JSON) -> None:
        with self._lock:
            self.append(f"{kind} {obj['metadata']['name']}")


def test_a_watch_that_keeps_ending_resumes_from_its_last_version_without_missing_anything(kube: Kube) -> None:
    seen = Seen()
    # The server ends this watch every second: it is restarted many times while we write.
    reflector = Reflector(kube, LEASES, namespace=kube.namespace, listener=seen, label_selector="test=resume",
                          watch_timeout_s=1)
    reflector.start()
    assert reflector.synced.wait(30)
    for i in range(40):
        kube.create(LEASES, lease(f"l-{i:02d}", "resume"))
        if i % 10 == 9:  # let the stream end and a new watch start between batches
            started = reflector.watches
            wait_for(lambda started=started: reflector.watches > started, message="the watch to be restarted")
    # The store takes an event before the listener does, and a stopped reflector delivers nothing.
    wait_for(lambda: len(reflector.store) == 40 and len(seen) == 40, message="every Lease in the store and told")
    reflector.stop()
    assert sorted(seen) == sorted(f"ADDED l-{i:02d}" for i in range(40))  # each once, none missed
    assert reflector.lists == 1  # resumed from resourceVersions, never listed again
    assert reflector.watches >= 5


def test_the_initial_list_comes_in_pages_and_misses_nothing(kube: Kube) -> None:
    for i in range(25):
        kube.create(LEASES, lease(f"p-{i:02d}", "pages"))
    pages = list(kube.list_pages(LEASES, label_selector="test=pages", limit=10))
    assert [len(p["items"]) for p in pages] == [10, 10, 5]
    seen = Seen()
    reflector = Reflector(kube, LEASES, namespace=kube.namespace, listener=seen, label_selector="test=pages",
                          page_size=10, keep_objects=False)
    reflector.start()
    assert reflector.synced.wait(30)
    reflector.stop()
    assert sorted(seen) == sorted(f"ADDED p-{i:02d}" for i in range(25))
    assert set(reflector.store) == {f"p-{i:02d}" for i in range(25)}
    first = pages[0]["items"][0]["metadata"]
    assert reflector.store["p-00"] == (first["uid"], first["resourceVersion"])  # the identity only


def test_a_watch_without_rights_stops_and_says_why(cluster, namespace: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from conftest import service_account_kubeconfig

    nobody = Kube.connect(kubeconfig=str(service_account_kubeconfig(cluster, namespace, "watch-nobody",
                                                                    "no-such-role", tmp_path)))
    reflector = Reflector(nobody, LEASES, namespace=namespace, listener=lambda kind, obj: None)
    reflector.start()
    reflector._thread.join(30)
    assert not reflector._thread.is_alive()  # no retry loop against a permanent refusal
    assert isinstance(reflector.error, errors.Forbidden)


def test_a_watch_resumed_from_a_compacted_version_lists_again_and_reports_what_changed_meanwhile(
        cluster: Cluster, kube: Kube) -> None:
    if cluster.etcd_port is None:
        pytest.skip("needs the local control plane's etcd")

    def template(name: str) -> JSON:
        return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name, "labels": {"test": "gone"}},
                "template": {"spec": {"containers": [{"name": "c", "image": "none"}]}}}

    kube.create(PODTEMPLATES, template("deleted-meanwhile"))
    kube.create(PODTEMPLATES, template("kept"))
    seen: list[str] = []
    held, resume = threading.Event(), threading.Event()

    def listener(kind: str, obj: JSON) -> None:
        seen.append(f"{kind} {obj['metadata']['name']}")
        if not held.is_set():  # the first event of the first list: keep the reflector here
            held.set()
            resume.wait(60)

    reflector = Reflector(kube, PODTEMPLATES, namespace=kube.namespace, listener=listener, label_selector="test=gone")
    reflector.start()
    try:
        assert held.wait(30)
        # The list's version, which the watch will resume from, leaves etcd's history: the
        # changes made meanwhile can no longer be streamed, only listed.
        kube.delete(PODTEMPLATES, "deleted-meanwhile")
        kube.create(PODTEMPLATES, template("created-meanwhile"))
        compact_etcd(cluster.etcd_port)
        resume.set()
        # Two from the first list, three from the second (the deletion last).
        wait_for(lambda: len(seen) >= 5, message="the reflector to list again")
    finally:
        resume.set()
        reflector.stop()
    assert reflector.lists == 2  # the 410 made it list again
    assert set(reflector.store) == {"kept", "created-meanwhile"}  # nothing stale
    first, relisted = sorted(seen[:2]), sorted(seen[2:])
    assert first == ["ADDED deleted-meanwhile", "ADDED kept"]
    assert relisted == ["ADDED created-meanwhile", "ADDED kept", "DELETED deleted-meanwhile"]
    assert reflector.error is None


def test_a_list_that_outlives_its_snapshot_goes_on_and_its_watch_brings_what_changed_before(
        cluster: Cluster, kube: Kube) -> None:
    """A deep queue listed by many agents at once can take longer than etcd keeps the list's
    snapshot (the API server compacts every five minutes). Starting over could fail the same
    way for ever: the rest is listed as it is now, and the watch, from the first page's
    version, brings what changed meanwhile among what was listed before."""
    if cluster.etcd_port is None:
        pytest.skip("needs the local control plane's etcd")

    for name in ("a", "b", "c", "d", "e", "f"):
        kube.create(LEASES, lease(name, "outlive"))
    first_page = next(kube.list_pages(LEASES, label_selector="test=outlive", limit=2))
    holders: dict[str, str] = {}
    held, go_on = threading.Event(), threading.Event()

    def listener(kind: str, obj: JSON) -> None:
        name = obj["metadata"]["name"]
        holders[name] = "(deleted)" if kind == "DELETED" else obj["spec"].get("holderIdentity", "")
        if name == "b" and not held.is_set():  # the first page's last: keep the list here
            held.set()
            go_on.wait(60)

    reflector = Reflector(kube, LEASES, namespace=kube.namespace, listener=listener, label_selector="test=outlive",
                          page_size=2)
    reflector.start()
    try:
        assert held.wait(30)
        # Meanwhile, among what was listed (a, b) and before what was not (c...):
        kube.merge_patch(LEASES, "a", {"spec": {"holderIdentity": "changed"}})
        kube.delete(LEASES, "b")
        kube.create(LEASES, lease("bb", "outlive"))
        compact_etcd(cluster.etcd_port)

        def expired() -> bool:
            try:
                next(kube.list_pages(LEASES, label_selector="test=outlive", limit=2,
                                     start=first_page["metadata"]["continue"]))
            except errors.Gone:
                return True
            return False
        wait_for(expired, timeout=60, message="the list's snapshot to be dropped")
        go_on.set()
        # Until the deletion too: the watch brings it after the change, and a stopped reflector delivers nothing.
        wait_for(lambda: reflector.synced.is_set() and holders.get("a") == "changed" and "bb" in holders
                 and holders.get("b") == "(deleted)", message="the list to end and the watch to bring what changed")
    finally:
        go_on.set()
        reflector.stop()
    assert reflector.resumed == 1
    assert reflector.lists == 1  # not listed again from the start
    assert set(reflector.store) == {"a", "bb", "c", "d", "e", "f"}
    assert holders["a"] == "changed" and holders["b"] == "(deleted)"
    assert reflector.error is None


def test_a_streaming_list_misses_nothing_and_the_watch_opened_before_it_goes_on(kube: Kube) -> None:
    """`watch_list=True`: the first list arrives as a watch's initial events, from the API
    server's watch cache; the watch that follows was opened just before it."""
    for i in range(25):
        kube.create(LEASES, lease(f"s-{i:02d}", "stream"))
    seen = Seen()
    watch, timeouts = kube.watch, []

    def timed(*args: object, timeout_s: int, **kwargs: object) -> Iterator[JSON]:
        timeouts.append(timeout_s)
        return watch(*args, timeout_s=timeout_s, **kwargs)  # type: ignore[arg-type]
    kube.watch = timed  # type: ignore[method-assign]
    reflector = Reflector(kube, LEASES, namespace=kube.namespace, listener=seen, label_selector="test=stream",
                          page_size=10, keep_objects=False, watch_list=True, watch_timeout_s=300)
    reflector.start()
    assert reflector.synced.wait(30)
    assert reflector.watch_list and reflector.lists == 1 and reflector.pages == 3  # 10, 10, and the last 5
    # A deep queue listed by many agents at once takes minutes: more than a watch's timeout.
    assert timeouts == [LIST_TIMEOUT_S, LIST_TIMEOUT_S] and LIST_TIMEOUT_S > 300
    assert sorted(seen) == sorted(f"ADDED s-{i:02d}" for i in range(25))
    tellers: set[str] = set()

    def told_by(kind: str, obj: JSON) -> None:
        tellers.add(threading.current_thread().name)
        seen(kind, obj)
    reflector.listener = told_by
    kube.create(LEASES, lease("s-late", "stream"))
    kube.delete(LEASES, "s-00")
    wait_for(lambda: "DELETED s-00" in seen and "ADDED s-late" in seen, message="the changes after the list")
    assert reflector.watches == 2  # the list, and the watch opened before it
    # Its events are told by the thread that reads them, not relayed to the list's thread.
    assert tellers == {"watch-leases-pinned"}
    reflector.stop()
    assert set(reflector.store) == {f"s-{i:02d}" for i in range(1, 25)} | {"s-late"}


def test_delivered_says_up_to_which_version_everything_was_told_and_a_watch_from_it_misses_nothing(
        kube: Kube) -> None:
    """`Reflector.delivered` is empty while a list, and what changed while it was read, are
    still being told; then it is the version up to which everything was, and a watch started
    from it (`since`, no list: how an agent narrows a watch) tells what comes next only."""
    for i in range(6):
        kube.create(LEASES, lease(f"d-{i}", "delivered"))
    watch, changed = kube.watch, []

    def during(events: Iterator[JSON]) -> Iterator[JSON]:
        for i, event in enumerate(events):
            if i == 3 and not changed:  # halfway through the list: one comes, one goes
                changed.append(kube.create(LEASES, lease("d-new", "delivered")))
                kube.delete(LEASES, "d-5")
                wait_for(lambda: {"d-new", "d-5"} <= set(getattr(reflector._pinned, "_waiting", ())),
                         message="the watch opened before the list to hear both")
            yield event

    def listing(*args: Any, initial_events: bool = False, **kwargs: Any) -> Iterator[JSON]:
        events = watch(*args, initial_events=initial_events, **kwargs)
        return during(events) if initial_events else events
    kube.watch = listing  # type: ignore[method-assign]
    told: list[tuple[str, str]] = []  # "KIND name", and `delivered` as the listener was called
    reflector = Reflector(kube, LEASES, namespace=kube.namespace, label_selector="test=delivered",
                          listener=lambda kind, obj: told.append((f"{kind} {obj['metadata']['name']}",
                                                                  reflector.delivered)),
                          keep_objects=False, watch_list=True)
    reflector.start()
    wait_for(lambda: reflector.delivered != "", message="the list and what came meanwhile told")
    assert sorted(e for e, _ in told) == sorted([*(f"ADDED d-{i}" for i in range(6)), "ADDED d-new", "DELETED d-5"])
    assert {d for _, d in told} == {""}  # nothing could be trusted to be told while they were
    assert int(reflector.delivered) >= int(changed[0]["metadata"]["resourceVersion"])
    after = Seen()
    narrower = Reflector(kube, LEASES, namespace=kube.namespace, label_selector="test=delivered", listener=after,
                         keep_objects=False, since=reflector.delivered)
    narrower.start()
    kube.create(LEASES, lease("d-after", "delivered"))
    wait_for(lambda: "ADDED d-after" in after, message="the next change, from the narrower watch")
    assert list(after) == ["ADDED d-after"] and narrower.lists == 0
    reflector.stop()
    narrower.stop()


def test_a_list_that_outlives_the_watch_caches_history_is_not_made_again(kube: Kube) -> None:
    """A deep queue that many agents list at once takes minutes, and by its end the API
    server's watch cache may no longer hold the events since the list's version (a watch from
    there is answered 410 Gone). The agents' Task watch was opened before the list: it misses
    nothing that changed while the list was read, and nothing is listed again."""
    for i in range(6):
        make_task(kube, f"h-{i}", queue="history")
    watch = kube.watch
    bookmark: list[str] = []
    gone: list[str] = []

    def during(events: Iterator[JSON]) -> Iterator[JSON]:
        for i, event in enumerate(events):
            if i == 3 and not bookmark:  # halfway through the first list: a task changes, one goes, one comes
                changed = kube.get(TASKS, "h-0")
                changed["metadata"]["labels"] = {"changed": "while-listed"}
                kube.replace(TASKS, changed)
                kube.delete(TASKS, "h-5")
                make_task(kube, "h-new", queue="history")
            if event["type"] == "BOOKMARK":
                bookmark.append(event["object"]["metadata"]["resourceVersion"])
            yield event

    def forgetful(*args: Any, initial_events: bool = False, resource_version: str, **kwargs: Any) -> Iterator[JSON]:
        if resource_version in bookmark:  # as the API server answers once its cache has moved on
            gone.append(resource_version)
            expired = {"type": "ERROR", "object": {"code": 410, "message": "too old resource version"}}
            return (event for event in [expired])
        events = watch(*args, initial_events=initial_events, resource_version=resource_version, **kwargs)
        return during(events) if initial_events else events
    listed = kube.list

    def versioned(*args: Any, limit: int = 0, **kwargs: Any) -> JSON:
        answer = listed(*args, limit=limit, **kwargs)
        if limit == 1 and not bookmark:  # the version read before the list: a change the list shows too
            changed = kube.get(TASKS, "h-1")
            changed["metadata"]["labels"] = {"changed": "before-the-list"}
            kube.replace(TASKS, changed)
        return answer
    kube.watch = forgetful  # type: ignore[method-assign]
    kube.list = versioned  # type: ignore[method-assign]
    seen = Seen()
    reflector = Reflector(kube, TASKS, namespace=kube.namespace, listener=seen, keep_objects=False,
                          field_selector=task_selector("history"), watch_field_selector=queue_selector("history"),
                          page_size=2, watch_list=True)
    reflector.start()
    assert reflector.synced.wait(30)
    wait_for(lambda: "ADDED h-new" in seen and "DELETED h-5" in seen and "MODIFIED h-0" in seen,
             message="the changes made while the list was read")
    make_task(kube, "h-late", queue="history")
    wait_for(lambda: "ADDED h-late" in seen, message="a change after the list")
    reflector.stop()
    assert reflector.lists == 1 and reflector.watches == 2 and gone == []
    assert seen.count("MODIFIED h-0") == 1  # its one change, told once
    assert seen.count("MODIFIED h-1") == 1  # listed changed, and told once more (no older state)
    assert set(reflector.store) == {f"h-{i}" for i in range(5)} | {"h-new", "h-late"}


def test_a_server_that_refuses_streaming_lists_gets_a_paginated_list(kube: Kube) -> None:
    kube.create(LEASES, lease("r-0", "refused"))
    watch = kube.watch

    def refusing(*args: object, initial_events: bool = False, **kwargs: object) -> Iterator[JSON]:
        if initial_events:  # as a server without the WatchList feature answers
            raise errors.Invalid("sendInitialEvents is forbidden for watch unless WatchList is enabled")
        return watch(*args, **kwargs)  # type: ignore[arg-type]
    kube.watch = refusing  # type: ignore[method-assign]
    reflector = Reflector(kube, LEASES, namespace=kube.namespace, listener=lambda kind, obj: None,
                          label_selector="test=refused", watch_list=True)
    reflector.start()
    assert reflector.synced.wait(30)
    reflector.stop()
    assert not reflector.watch_list and reflector.lists == 1 and set(reflector.store) == {"r-0"}


def test_a_streaming_list_cut_short_by_the_server_goes_on_in_pages_that_time(kube: Kube) -> None:
    """An API server ends the stream of a reader that falls behind the changes made while it
    lists (its stream then simply ends): that list is made in pages, and misses nothing; the
    next list streams again."""
    for i in range(5):
        kube.create(LEASES, lease(f"c-{i}", "cut"))
    watch = kube.watch
    cut: list[int] = []

    def first_two(events: Iterator[JSON]) -> Iterator[JSON]:
        try:
            for event in events:
                if len(cut) == 2:
                    return  # the server ended the stream here, before the bookmark that ends the list
                cut.append(1)
                yield event
        finally:
            events.close()  # type: ignore[attr-defined]

    def cutting(*args: object, initial_events: bool = False, **kwargs: object) -> Iterator[JSON]:
        events = watch(*args, initial_events=initial_events, **kwargs)  # type: ignore[arg-type]
        return first_two(events) if initial_events and not cut else events
    kube.watch = cutting  # type: ignore[method-assign]
    seen = Seen()
    reflector = Reflector(kube, LEASES, namespace=kube.namespace, listener=seen, label_selector="test=cut",
                          watch_list=True)
    reflector.start()
    assert reflector.synced.wait(30)
    assert reflector.cut_short == 1 and reflector.lists == 1 and reflector.watch_list  # the next list streams
    assert set(reflector.store) == {f"c-{i}" for i in range(5)}
    kube.create(LEASES, lease("c-late", "cut"))
    wait_for(lambda: "ADDED c-late" in seen, message="a change after the list")
    reflector.stop()


def test_a_watch_quiet_for_longer_than_the_read_timeout_ends_as_if_closed(
        kube: Kube, monkeypatch: pytest.MonkeyPatch) -> None:
    """No event and no bookmark for the client's read timeout (an idle queue's TaskQueue): the
    stream ends cleanly, to be resumed, instead of raising Unreachable (a warning each time)."""
    monkeypatch.setattr(client, "_WATCH_READ_TIMEOUT_S", 1)
    version = kube.list(LEASES, label_selector="test=quiet")["metadata"]["resourceVersion"]
    events = list(kube.watch(LEASES, namespace=kube.namespace, resource_version=version,
                             label_selector="test=quiet", timeout_s=60))
    assert [event["type"] for event in events if event["type"] != "BOOKMARK"] == []


def test_a_watch_the_server_ends_leaves_its_connection_to_the_next_request(kube: Kube) -> None:
    """The watch reads its chunked response itself (`tasklease.kube.chunked`): read to its last
    chunk, the response ends as http.client would end it, and the connection serves on."""
    pool = kube.connection.pool.connection_from_url(kube.connection.host)
    kube.list(LEASES, label_selector="test=ended")  # the connection is open
    before = pool.num_connections
    for _ in range(3):
        version = kube.list(LEASES, label_selector="test=ended")["metadata"]["resourceVersion"]
        kube.create(LEASES, lease(f"ended-{version}", "ended"))
        events = list(kube.watch(LEASES, namespace=kube.namespace, resource_version=version,
                                 label_selector="test=ended", timeout_s=1, batch_s=0.1))
        assert [event["type"] for event in events if event["type"] != "BOOKMARK"] == ["ADDED"]
    assert pool.num_connections == before  # every request and watch went over the one connection


def test_the_agents_task_watch_gets_a_finished_task_as_the_status_write_and_tells_it_as_deleted(kube: Kube) -> None:
    """The watch after the list selects the whole queue: the status write that finishes a
    task reaches it as MODIFIED (which the API server encodes once for every watcher), and the
    reflector tells its listener DELETED, as the list's selector would."""
    for name in ("w-a", "w-b"):
        make_task(kube, name, queue="wide")
    raw: list[tuple[str, str, str]] = []
    watch = kube.watch

    def recorded(*args: Any, field_selector: str = "", **kwargs: Any) -> Iterator[JSON]:
        for event in watch(*args, field_selector=field_selector, **kwargs):
            raw.append((field_selector, event["type"], event["object"]["metadata"].get("name", "")))
            yield event
    kube.watch = recorded  # type: ignore[method-assign]
    seen = Seen()
    reflector = Reflector(kube, TASKS, namespace=kube.namespace, listener=seen, keep_objects=False,
                          field_selector=task_selector("wide"), watch_field_selector=queue_selector("wide"),
                          watch_list=True)
    reflector.start()
    assert reflector.synced.wait(30)
    finished = kube.get(TASKS, "w-a")
    finished["status"] = {"phase": models.Phase.SUCCEEDED.value}
    kube.replace(TASKS, finished, sub="status")
    make_task(kube, "w-c", queue="wide")
    wait_for(lambda: "ADDED w-c" in seen, message="the task created after the finished one")
    finished = kube.get(TASKS, "w-a")
    finished["metadata"]["labels"] = {"touched": "yes"}  # a finished task changed again: not told
    kube.replace(TASKS, finished)
    kube.delete(TASKS, "w-b")
    wait_for(lambda: "DELETED w-b" in seen, message="the deleted task")
    reflector.stop()
    assert sorted(seen) == ["ADDED w-a", "ADDED w-b", "ADDED w-c", "DELETED w-a", "DELETED w-b"]
    assert seen.index("DELETED w-a") < seen.index("ADDED w-c")
    wide = [(kind, name) for selector, kind, name in raw if selector == queue_selector("wide") and kind != "BOOKMARK"]
    assert wide[:3] == [("MODIFIED", "w-a"), ("ADDED", "w-c"), ("MODIFIED", "w-a")]
    assert reflector.lists == 1 and reflector.watches == 2  # the streaming list, then the wider watch


def test_a_busy_watch_is_read_in_batches_and_an_event_after_a_quiet_spell_at_once(
        kube: Kube, monkeypatch: pytest.MonkeyPatch) -> None:
    """`batch_s`: the reader waits after a read that brought events when nothing more has
    arrived, never before an event that follows a quiet spell: a burst costs a few wake-ups,
    and a lone event is not delayed."""
    batch_s = 0.3
    waits: list[float] = []  # when each batching wait was over
    sleep = client.time.sleep

    def counted(seconds: float) -> None:
        sleep(seconds)
        if seconds == batch_s:
            waits.append(time.monotonic())
    monkeypatch.setattr(client.time, "sleep", counted)
    version = kube.list(LEASES, label_selector="test=batch")["metadata"]["resourceVersion"]
    seen: list[tuple[str, int]] = []  # (name, waits over when it was read)

    def read() -> None:
        for event in kube.watch(LEASES, namespace=kube.namespace, resource_version=version,
                                label_selector="test=batch", timeout_s=60, batch_s=batch_s):
            if event["type"] == "ADDED":
                seen.append((event["object"]["metadata"]["name"], len(waits)))
                if seen[-1][0] == "lone":
                    return
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    burst = [f"b-{i:02d}" for i in range(20)]
    with ThreadPoolExecutor(10) as pool:  # close together even on a slow machine
        list(pool.map(lambda name: kube.create(LEASES, lease(name, "batch")), burst))
    wait_for(lambda: len(seen) == len(burst), message="every event of the burst")
    time.sleep(2 * batch_s)  # a quiet spell: any wait after the burst is over, the reader blocked reading
    before = len(waits)
    kube.create(LEASES, lease("lone", "batch"))
    reader.join(30)
    assert sorted(name for name, _ in seen[:len(burst)]) == burst and seen[-1][0] == "lone"
    assert len({w for _, w in seen[:len(burst)]}) < len(burst)  # some read together, after one wait
    assert seen[-1][1] == before  # no wait before the lone event
    # Waits do not pile up: each ends a batch_s or more after the one before it.
    assert all(b - a >= batch_s for a, b in zip(waits, waits[1:], strict=False))

"""A Reflector whose watch selects more than its list: it narrows the events itself, so its
listener sees exactly what the list's selector would show (no API server: a scripted one)."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasklease.api import errors
from tasklease.kube import JSON, TASKS, watching
from tasklease.kube.client import INITIAL_EVENTS_END
from tasklease.kube.watching import Reflector

pytestmark = pytest.mark.unit

OPEN = "spec.queue=q,status.phase!=Succeeded,status.phase!=Failed"


def task(name: str, rv: str, phase: str | None = None, queue: str = "q") -> JSON:
    obj: JSON = {"metadata": {"name": name, "namespace": "ns", "uid": f"u-{name}", "resourceVersion": rv},
                 "spec": {"queue": queue}}
    if phase is not None:
        obj["status"] = {"phase": phase}
    return obj


class Scripted:
    """Answers the streaming list with `listed`, and the watch opened before it with `during`
    at once (changes made while the list is read) and `events` once `released` (after it);
    records the requests and the version each asked for."""

    def __init__(self, listed: list[JSON], events: list[tuple[str, JSON]],
                 during: Sequence[tuple[str, JSON]] = ()) -> None:
        self.listed, self.events, self.during = listed, events, list(during)
        self.requests: list[tuple[str, str]] = []
        self.versions: list[str] = []
        self.released = threading.Event()  # set: no list to wait for (`run` holds it back)
        self.released.set()
        self.told = threading.Event()  # the watch's reader holds every change of `during`

    def list(self, res: Any, *, field_selector: str = "", limit: int = 0, **_: Any) -> JSON:
        assert limit == 1  # only the version is read
        self.requests.append(("version", field_selector))
        return {"metadata": {"resourceVersion": "9"}, "items": []}

    def watch(self, res: Any, *, field_selector: str = "", initial_events: bool = False,
              resource_version: str, **_: Any) -> Iterator[JSON]:
        self.versions.append(resource_version)
        if initial_events:
            self.requests.append(("list", field_selector))
            yield from ({"type": "ADDED", "object": obj} for obj in self.listed)
            assert self.told.wait(10)  # they came while the list was read
            yield {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "10",
                                                               "annotations": {INITIAL_EVENTS_END: "true"}}}}
            raise AssertionError("the streaming list went on after its end, in place of the watch")
        self.requests.append(("watch", field_selector))
        try:
            yield from ({"type": kind, "object": obj} for kind, obj in self.during)
        finally:  # its reader asked for more (it has the last of them), or gave up on it
            self.told.set()
        assert self.released.wait(10)
        yield from ({"type": kind, "object": obj} for kind, obj in self.events)


# Who keeps what the picture holds: the listener, which names it (`known`), also asked one
# name at a time (`knows`); or the reflector's store, which keeps each object's identity.
KEEPERS = ["listener-keeps-names", "listener-answers-names", "store-keeps-identities"]


def run(kube: Scripted, *, keeper: str) -> tuple[list[str], Reflector]:
    seen: list[str] = []
    names: set[str] = set()
    known = keeper != "store-keeps-identities"

    def listener(kind: str, obj: JSON) -> None:
        seen.append(f"{kind} {obj['metadata']['name']}")
        (names.discard if kind == "DELETED" else names.add)(obj["metadata"]["name"])
    reflector = Reflector(kube, TASKS, namespace="ns", listener=listener,  # type: ignore[arg-type]
                          field_selector=OPEN, watch_field_selector="spec.queue=q", keep_objects=False,
                          known=(lambda: names) if known else None,
                          knows=names.__contains__ if keeper == "listener-answers-names" else None, watch_list=True)
    kube.released.clear()
    reflector._list_and_watch()  # the streaming list, which ends at its bookmark
    assert reflector.synced.is_set() and ("list", OPEN) in kube.requests
    kube.released.set()
    reflector._list_and_watch()  # then the watch opened before it, with its own selector
    return seen, reflector


@pytest.mark.parametrize("keeper", KEEPERS)
def test_a_wider_watch_is_narrowed_to_what_the_list_selects(keeper: str) -> None:
    kube = Scripted(
        listed=[task("a", "5"), task("b", "6", "Running")],
        events=[("MODIFIED", task("a", "11", "Succeeded")),  # finishes: it leaves the picture
                ("MODIFIED", task("a", "12", "Succeeded")),  # a finished task changed again: not told
                ("DELETED", task("a", "13", "Succeeded")),  # and deleted: not told either
                ("MODIFIED", task("c", "14", "Pending")),  # one the list did not show starts to match
                ("MODIFIED", task("c", "15", "Running")),
                ("MODIFIED", task("b", "16", "Failed")),
                ("MODIFIED", task("b", "17", "Pending")),  # back among the open ones
                ("DELETED", task("c", "18", "Running"))])
    seen, reflector = run(kube, keeper=keeper)
    assert sorted(kube.requests) == [("list", OPEN), ("version", ""), ("watch", "spec.queue=q")]
    assert kube.versions == ["9", "9"]  # the list as of the version the watch starts from, or later
    assert seen == ["ADDED a", "ADDED b", "DELETED a", "ADDED c", "MODIFIED c", "DELETED b", "ADDED b",
                    "DELETED c"]
    assert reflector._rv == "18"  # every event moves the version on, told or not
    assert sorted(reflector.store) == ([] if keeper != "store-keeps-identities" else ["b"])


@pytest.mark.parametrize("keeper", KEEPERS)
def test_what_changed_while_the_list_was_read_is_told_after_it_each_object_as_it_is_last(keeper: str) -> None:
    """The watch opened before the list holds every change since the version the list was read
    at or after: some are in the list already, and only each object's last one is news. None
    is told before the list has ended, and the watch never asks for the list's own version."""
    kube = Scripted(
        listed=[task("a", "12", "Running"), task("b", "6"), task("d", "7")],
        during=[("MODIFIED", task("a", "11")),  # older than the list's "a": not told as it was
                ("MODIFIED", task("a", "12", "Running")),  # what the list showed
                ("ADDED", task("c", "13")),  # created after the list passed its place
                ("MODIFIED", task("b", "14", "Succeeded")),  # finished after the list showed it
                ("MODIFIED", task("d", "15", "Succeeded")),
                ("MODIFIED", task("d", "16"))],  # and retried: open again, as the list showed it
        events=[("MODIFIED", task("a", "17", "Succeeded"))])
    seen, reflector = run(kube, keeper=keeper)
    assert seen[:3] == ["ADDED a", "ADDED b", "ADDED d"]  # the list
    # While it was read: the last change of each.
    assert sorted(seen[3:7]) == ["ADDED c", "DELETED b", "MODIFIED a", "MODIFIED d"]
    assert seen[7:] == ["DELETED a"]  # after it
    assert "10" not in kube.versions and reflector._rv == "17" and reflector.lists == 1
    assert sorted(reflector.store) == ([] if keeper != "store-keeps-identities" else ["c", "d"])


def test_too_many_objects_changed_while_the_list_was_read_and_the_watch_starts_after_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What waits for the list's end is bounded: beyond `_PINNED_MAX` objects changed, the
    watch opened before the list is given up, and the watch after it is asked for from the
    list's own version (then the API server has every change since, or answers 410)."""
    monkeypatch.setattr(watching, "_PINNED_MAX", 2)
    kube = Scripted(listed=[task("a", "5")], events=[],
                    during=[("ADDED", task(name, rv)) for name, rv in (("b", "11"), ("c", "12"), ("d", "13"))])
    seen, reflector = run(kube, keeper="store-keeps-identities")
    assert seen == ["ADDED a"] and reflector._rv == "10"  # the list's: nothing that waited was told
    reflector._list_and_watch()
    assert kube.versions[-1] == "10" and kube.requests[-1] == ("watch", "spec.queue=q")


def test_a_watch_opened_before_a_list_that_failed_raises_its_failure_after_its_events() -> None:
    """The watch opened before the list fails: what it brought is told, then its failure is
    raised as a watch's own would be (a 410 lists again)."""
    kube = Scripted(listed=[task("a", "5")], events=[],
                    during=[("ADDED", task("b", "11")),
                            ("ERROR", {"code": 410, "message": "too old resource version"})])
    seen: list[str] = []
    reflector = Reflector(kube, TASKS, namespace="ns", watch_list=True,  # type: ignore[arg-type]
                          listener=lambda kind, obj: seen.append(f"{kind} {obj['metadata']['name']}"))
    reflector._list_and_watch()
    with pytest.raises(errors.Gone):
        reflector._list_and_watch()
    assert seen == ["ADDED a", "ADDED b"] and reflector._rv == "11"


def test_a_watch_whose_close_fails_still_ends_and_its_failure_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    """Given up on (too many changes while the list was read), the watch opened before it is
    closed; a close that fails ends it all the same: the reflector never waits on it for ever."""
    monkeypatch.setattr(watching, "_PINNED_MAX", 1)
    kube = Scripted(listed=[], events=[], during=[("ADDED", task("b", "11")), ("ADDED", task("c", "12"))])
    watch = kube.watch

    def failing_close(*args: Any, **kwargs: Any) -> Iterator[JSON]:
        try:
            yield from watch(*args, **kwargs)
        finally:
            if not kwargs.get("initial_events"):
                raise RuntimeError("the connection could not be closed")
    kube.watch = failing_close  # type: ignore[method-assign]
    reflector = Reflector(kube, TASKS, namespace="ns", listener=lambda *_: None,  # type: ignore[arg-type]
                          watch_list=True)
    reflector._list_and_watch()
    with pytest.raises(RuntimeError, match="could not be closed"):
        reflector._list_and_watch()


def test_without_a_wider_watch_the_list_and_the_watch_select_alike_and_events_pass_as_sent() -> None:
    seen: list[str] = []
    kube = Scripted(listed=[task("a", "5")], events=[("MODIFIED", task("a", "11", "Succeeded"))])
    reflector = Reflector(kube, TASKS, namespace="ns", field_selector=OPEN,  # type: ignore[arg-type]
                          listener=lambda kind, obj: seen.append(f"{kind} {obj['metadata']['name']}"))
    reflector._rv = "10"
    reflector._list_and_watch()
    assert kube.requests == [("watch", OPEN)] and seen == ["MODIFIED a"]


@pytest.mark.parametrize(("selector", "obj", "selected"), [
    ("spec.queue=q", {"spec": {"queue": "q"}}, True),
    ("spec.queue==q", {"spec": {"queue": "q"}}, True),
    ("spec.queue=q", {"spec": {"queue": "r"}}, False),
    ("status.phase!=Succeeded", {}, True),  # an absent field is the empty string
    ("status.phase=", {"status": None}, True),
    ("status.phase!=Succeeded", {"status": {"phase": "Succeeded"}}, False),
    ("spec.cancel=true", {"spec": {"cancel": True}}, True),  # not a string: as JSON writes it
    ("spec.queue=q,status.phase!=Failed", {"spec": {"queue": "q"}, "status": {"phase": "Failed"}}, False),
])
def test_a_field_selector_is_judged_as_the_api_server_judges_it(selector: str, obj: JSON, selected: bool) -> None:
    kube = Scripted(listed=[], events=[("MODIFIED", {**obj, "metadata": {"name": "x", "resourceVersion": "11"}})])
    seen: list[str] = []
    reflector = Reflector(kube, TASKS, namespace="ns", field_selector=selector,  # type: ignore[arg-type]
                          watch_field_selector="metadata.namespace=ns", listener=lambda kind, _: seen.append(kind))
    reflector._rv = "10"
    reflector._list_and_watch()
    assert seen == (["ADDED"] if selected else [])


def test_a_selector_term_without_an_operator_is_refused_at_once() -> None:
    with pytest.raises(ValueError, match="not a field selector requirement"):
        Reflector(Scripted([], []), TASKS, namespace="ns", listener=lambda *_: None,  # type: ignore[arg-type]
                  field_selector="spec.queue", watch_field_selector="spec.queue=q")


@settings(max_examples=200, deadline=None)
@given(before=st.sets(st.text(alphabet="ab-", min_size=1, max_size=4), max_size=24),
       after=st.sets(st.text(alphabet="ab-", min_size=1, max_size=4), max_size=24), known=st.booleans())
def test_a_list_made_again_reports_as_deleted_exactly_what_it_no_longer_brings(
        before: set[str], after: set[str], known: bool) -> None:
    names: set[str] = set()
    deleted: list[str] = []

    def listener(kind: str, obj: JSON) -> None:
        name = obj["metadata"]["name"]
        if kind == "DELETED":
            deleted.append(name)
            names.discard(name)
        else:
            names.add(name)
    kube = Scripted([task(n, "1") for n in before], [])
    reflector = Reflector(kube, TASKS, namespace="ns", listener=listener,  # type: ignore[arg-type]
                          field_selector=OPEN, watch_field_selector="spec.queue=q", keep_objects=False,
                          known=(lambda: names) if known else None, watch_list=True)
    assert reflector.synced_at is None
    assert reflector._stream()
    first = reflector.synced_at
    assert first is not None
    kube.listed = [task(n, "2") for n in after]  # listed in the order a set gives, not sorted
    reflector._rv = ""  # as after a 410
    assert reflector._stream()
    assert sorted(deleted) == sorted(before - after) and names == after
    assert reflector.synced_at == first  # when the view was first whole, not when it was last listed
    assert known or set(reflector.store) == after


class Paged:
    """Answers a paginated list from `listed`, `size` a page, its continue token the index of
    the page's first object; a page whose index is in `failing` fails once, as a timeout does."""

    def __init__(self, listed: list[JSON], size: int, failing: set[int]) -> None:
        self.listed, self.size, self.failing = listed, size, failing
        self.asked: list[str] = []

    def list_pages(self, res: Any, *, start: str = "", **_: Any) -> Iterator[JSON]:
        at = int(start or 0)
        while True:
            self.asked.append(str(at))
            if at in self.failing:
                self.failing.discard(at)
                raise errors.Unreachable("cannot reach the Kubernetes API server: read timed out")
            following = at + self.size
            more = {"continue": str(following)} if following < len(self.listed) else {}
            yield {"items": iter(self.listed[at:following]), "metadata": {"resourceVersion": "7", **more}}
            if not more:
                return
            at = following


def test_a_page_that_fails_is_asked_for_again_and_the_list_goes_on_from_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(watching, "_RETRY_BASE_S", 0.001)
    seen: list[str] = []
    kube = Paged([task(f"t{i}", "7") for i in range(10)], size=3, failing={0, 6})
    reflector = Reflector(kube, TASKS, namespace="ns", listener=lambda kind, obj: seen.append(  # type: ignore[arg-type]
        obj["metadata"]["name"]), field_selector=OPEN)
    reflector._relist()
    # The first page again, then the third page again, from its own token: nothing listed twice.
    assert kube.asked == ["0", "0", "3", "6", "6", "9"]
    assert seen == [f"t{i}" for i in range(10)]
    assert reflector.synced.is_set() and reflector.retried == 2 and reflector.lists == 1 and reflector.error is None


def test_a_reflector_stopped_while_a_failed_page_waits_lists_and_watches_no_more() -> None:
    kube = Paged([task("t0", "7")], size=3, failing={0})
    reflector = Reflector(kube, TASKS, namespace="ns", listener=lambda kind, obj: None,  # type: ignore[arg-type]
                          field_selector=OPEN)
    reflector.stop()
    reflector._list_and_watch()  # no watch request: Paged has none to answer
    assert kube.asked == ["0"] and not reflector.synced.is_set()
    assert isinstance(reflector.error, errors.Unreachable)

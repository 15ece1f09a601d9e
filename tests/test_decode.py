"""Reading deeply nested objects without a control plane (the kube layer's decoder)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasklease.api import models
from tasklease.kube import decode

pytestmark = pytest.mark.unit  # pure: no control plane


def _nested(depth: int) -> str:
    return '{"a":[' * depth + '"x]}{["' + "]}" * depth


def test_an_object_too_deep_for_json_is_read_with_its_depths_cut_and_stays_invalid() -> None:
    text = '{"metadata":{"name":"deep"},"spec":{"payload":' + _nested(6_000) + '},"after":"kept"}'
    obj = decode.loads(text.encode())
    assert obj["metadata"]["name"] == "deep" and obj["after"] == "kept"
    assert models.payload_depth(obj["spec"]["payload"]) > models.MAX_PAYLOAD_DEPTH  # still refused
    assert decode.TOO_DEEP in json.dumps(obj)


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(alphabet='ab"\\[]{}'),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                                      max_size=3), max_leaves=20)


@settings(deadline=None)  # no timing in tests: a loaded machine is slow
@given(json_values)
def test_flatten_keeps_every_object_within_its_depth_as_it_was(value: object) -> None:
    data = json.dumps(value).encode()
    assert json.loads(decode.flatten(data, 64)) == value


@settings(deadline=None)  # no timing in tests: a loaded machine is slow
@given(json_values, st.integers(min_value=1, max_value=4))
def test_flatten_cuts_exactly_what_nests_deeper(value: object, depth: int) -> None:
    cut = json.loads(decode.flatten(json.dumps(value).encode(), depth))
    assert models.payload_depth(cut) <= depth


any_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                   max_size=3), max_leaves=20)


@settings(deadline=None)  # no timing in tests: a loaded machine is slow
@given(any_json, st.booleans(), st.integers(min_value=0, max_value=400))
def test_loads_reads_what_json_reads(value: object, ascii_only: bool, depth: int) -> None:
    """Whichever parser reads it (pydantic's first, json's for what that one refuses: its
    nesting limit lies within these depths), the value is json's."""
    text = "[" * depth + json.dumps(value, ensure_ascii=ascii_only) + "]" * depth
    assert decode.loads(text.encode()) == json.loads(text)


@pytest.mark.parametrize("text", ['"\\ud800"', '{"a":1,"a":2}', "\ufeff{}", "1e400"])
def test_loads_reads_the_odd_json_as_json_does(text: str) -> None:
    data = text.encode()
    assert decode.loads(data) == json.loads(data)


@pytest.mark.parametrize("data", [b'{"a":1', b"\xff", b"{}{}"])
def test_loads_refuses_what_json_refuses_with_its_error(data: bytes) -> None:
    with pytest.raises(ValueError) as theirs:
        json.loads(data)
    with pytest.raises(ValueError) as ours:
        decode.loads(data)
    assert (type(ours.value), str(ours.value)) == (type(theirs.value), str(theirs.value))


def _read(data: bytes) -> object:
    """A page as `decode.loads_page` gives it, its items iterated to their end."""
    page = decode.loads_page(data)
    items = page.get("items")
    if isinstance(items, Iterator):
        page["items"] = list(items)  # before the keys that follow are looked at
    return page


pages = st.dictionaries(st.sampled_from(["apiVersion", "kind", "metadata", "items", "x"]), json_values, max_size=5)


@settings(deadline=None)  # no timing in tests: a loaded machine is slow
@given(pages, st.lists(json_values, max_size=5), st.booleans(), st.sampled_from(["", " ", "\n  "]))
def test_a_page_decoded_an_item_at_a_time_reads_as_json_reads_it(page: dict[str, object], items: list[object],
                                                                  listed: bool, blank: str) -> None:
    if listed:
        page["items"] = items
    data = json.dumps(page, indent=len(blank) or None, separators=None if blank else (",", ":"))
    assert _read((blank + data + blank).encode()) == json.loads(data)
    assert _read(("\ufeff" + data).encode()) == json.loads(data.encode("utf-8-sig"))  # a byte order mark


def test_a_page_with_an_item_too_deep_gives_every_item_once_the_deep_one_cut() -> None:
    data = ('{"apiVersion":"v1","items":[{"n":1},{"n":2,"deep":' + _nested(6_000) + '},{"n":3}],'
            '"metadata":{"continue":"c"}}').encode()
    page = decode.loads_page(data)
    items = list(page["items"])
    assert [item["n"] for item in items] == [1, 2, 3] and page["metadata"] == {"continue": "c"}
    assert decode.TOO_DEEP in json.dumps(items[1]) and page["apiVersion"] == "v1"


def test_an_answer_that_is_not_json_is_refused_as_json_refuses_it() -> None:
    for bad in (b'{"items":[1,2', b'{"items":[1 2]}', b'[1]', b'', b'{"items":[1,]}', b'{"a":1,}', b'{1:2}',
                b'{"items":[]} {}', b'{"a" 1}'):
        try:
            _read(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} was read")

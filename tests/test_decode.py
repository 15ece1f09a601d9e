"""Reading deeply nested objects without a control plane (the kube layer's decoder)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from tasklease.api import models
from tasklease.kube import decode


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

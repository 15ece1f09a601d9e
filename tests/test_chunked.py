"""A chunked HTTP/1.1 body decoded from its bytes in any pieces (the kube layer's watch reader)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasklease.kube.chunked import Dechunker, MalformedChunk

pytestmark = pytest.mark.unit  # pure: no control plane


def _encode(pieces: list[bytes], *, extension: bytes = b"", trailer: bytes = b"") -> bytes:
    return b"".join(b"%x%s\r\n%s\r\n" % (len(p), extension, p) for p in pieces if p) + b"0\r\n" + trailer + b"\r\n"


def _feed(body: bytes, cuts: list[int]) -> tuple[bytes, Dechunker]:
    dechunk, out, start = Dechunker(), [], 0
    for cut in sorted({c % (len(body) + 1) for c in cuts}) + [len(body)]:
        out.append(dechunk.feed(body[start:cut]))
        start = cut
    return b"".join(out), dechunk


@settings(deadline=None)  # no timing in tests: a loaded machine is slow
@given(st.lists(st.binary(max_size=40), max_size=8), st.lists(st.integers(0, 10_000), max_size=12),
       st.sampled_from([b"", b";name=value"]), st.sampled_from([b"", b"X-Trailer: 1\r\n"]))
def test_the_data_comes_out_whole_however_the_bytes_are_cut(pieces: list[bytes], cuts: list[int],
                                                            extension: bytes, trailer: bytes) -> None:
    data, dechunk = _feed(_encode(pieces, extension=extension, trailer=trailer), cuts)
    assert data == b"".join(pieces)
    assert dechunk.ended


def test_it_has_not_ended_before_the_empty_line_after_the_last_chunk() -> None:
    dechunk = Dechunker()
    assert dechunk.feed(b"3\r\nabc\r\n0\r\n") == b"abc"
    assert not dechunk.ended
    assert dechunk.feed(b"\r\nwhat follows is not its body") == b""
    assert dechunk.ended


@pytest.mark.parametrize("body", [b"zz\r\nabc\r\n", b"3\r\nabcXY", b"-3\r\nabc\r\n", b"1" * 2000])
def test_bytes_that_are_not_a_chunked_body_are_refused(body: bytes) -> None:
    with pytest.raises(MalformedChunk):
        Dechunker().feed(body)

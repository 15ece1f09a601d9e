"""A watch's chunked body read a batch at a time (`kube.stream`), over a local socket pair
standing in for the API server's connection: lines whole wherever the chunks and reads cut
them, the end of the stream, what is not a stream, and the batching itself."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from tasklease.api import errors
from tasklease.kube import stream

pytestmark = pytest.mark.unit


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, Any]]:
    """The server's end, and a response as urllib3 hands one over (its headers read)."""
    server, client = socket.socketpair()
    reader = client.makefile("rb")
    resp = SimpleNamespace(_fp=SimpleNamespace(fp=reader, chunked=True), connection=SimpleNamespace(sock=client))
    yield server, resp
    reader.close()
    server.close()
    client.close()


def test_lines_whole_however_the_bytes_arrive(pair: tuple[socket.socket, Any]) -> None:
    server, resp = pair
    events = [b'{"type":"ADDED","n":%d}' % i for i in range(5)]
    # Two events in one chunk, one event over two chunks, a chunk extension, and blank lines.
    body = (chunk(events[0] + b"\n" + events[1] + b"\n") + chunk(events[2][:7]) + chunk(events[2][7:] + b"\n")
            + b"%x;ext=1\r\n%s\r\n" % (len(events[3]) + 2, events[3] + b"\n\n") + chunk(events[4] + b"\n")
            + b"0\r\n\r\n")

    def send() -> None:
        for at in range(0, len(body), 5):  # cut everywhere, sizes and line ends included
            server.sendall(body[at:at + 5])
            time.sleep(0.001)
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    assert list(stream.lines(resp)) == events
    sender.join()


def test_a_connection_closed_before_the_last_chunk_is_unreachable(pair: tuple[socket.socket, Any]) -> None:
    server, resp = pair
    server.sendall(chunk(b'{"a":1}\n') + chunk(b'{"b":'))
    server.shutdown(socket.SHUT_WR)
    lines = stream.lines(resp)
    assert next(lines) == b'{"a":1}'
    with pytest.raises(errors.Unreachable, match="closed the connection"):
        next(lines)


def test_what_is_not_chunked_is_refused(pair: tuple[socket.socket, Any]) -> None:
    server, resp = pair
    with pytest.raises(errors.ServerError, match="not a chunked stream"):
        next(stream.lines(SimpleNamespace(_fp=SimpleNamespace(fp=resp._fp.fp, chunked=False),
                                          connection=resp.connection)))
    server.sendall(b"zz\r\n{}\r\n")
    with pytest.raises(errors.ServerError, match="not valid chunked encoding"):
        next(stream.lines(resp))


def test_events_that_arrive_while_it_waits_out_a_batch_are_read_at_one_wake_up(
        pair: tuple[socket.socket, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    server, resp = pair
    waits: list[float] = []
    stop = threading.Event()
    real_wait = stop.wait

    def wait(timeout: float) -> bool:
        waits.append(timeout)
        if len(waits) == 1:  # while the reader waits out its first batch, three events come
            for i in range(3):
                server.sendall(chunk(b'{"n":%d}\n' % i))
        return real_wait(timeout)
    monkeypatch.setattr(stop, "wait", wait)
    blocking: list[int] = []
    read = stream._Body.read

    def counted(body: stream._Body) -> bytes:
        blocking.append(int(body.more()))
        return read(body)
    monkeypatch.setattr(stream._Body, "read", counted)
    server.sendall(chunk(b'{"first":1}\n'))
    lines = stream.lines(resp, batch_s=0.2, stop=stop)
    assert next(lines) == b'{"first":1}'  # a quiet stream's first event: at once, no wait
    assert waits == []
    assert [next(lines) for _ in range(3)] == [b'{"n":0}', b'{"n":1}', b'{"n":2}']
    assert len(waits) == 1 and 0 < waits[0] <= 0.2
    # One read that could wait per wake-up: the first event's, then the batch's; the rest of
    # the batch was read without waiting.
    assert blocking.count(0) <= 2 and len(blocking) >= 2


def test_stop_ends_the_wait_for_a_batch(pair: tuple[socket.socket, Any]) -> None:
    server, resp = pair
    stop = threading.Event()
    server.sendall(chunk(b'{"first":1}\n'))
    lines = stream.lines(resp, batch_s=30.0, stop=stop)
    assert next(lines) == b'{"first":1}'
    threading.Timer(0.05, stop.set).start()
    began = time.monotonic()
    assert list(lines) == []
    assert time.monotonic() - began < 5


def test_a_reader_behind_reads_on_without_waiting(pair: tuple[socket.socket, Any],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    server, resp = pair
    monkeypatch.setattr(stream, "_READ", 32)
    monkeypatch.setattr(stream, "_BATCH_BYTES", 64)  # a batch cut after 64 bytes: what is left waits unread
    stop = threading.Event()
    waits: list[float] = []
    monkeypatch.setattr(stop, "wait", lambda timeout: waits.append(timeout) or False)
    events = [b'{"n":%d,"pad":"%s"}' % (i, b"x" * 40) for i in range(6)]
    server.sendall(b"".join(chunk(e + b"\n") for e in events))
    time.sleep(0.05)  # all of it on the socket before the first read
    lines = stream.lines(resp, batch_s=30.0, stop=stop)
    assert [next(lines) for _ in events] == events
    assert waits == []  # every batch but the last was cut short: none waited

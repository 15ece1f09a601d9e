"""A watch's response body, read a batch at a time: whatever has arrived is read at one wake-up.

The API server writes each watch event as one HTTP chunk, as soon as it happens. Read as they
arrive, each event costs its reader a wake-up: a thread scheduled, a blocking read returned,
the GIL taken back. On a busy queue every agent follows every task's last status write, and
those wake-ups were most of what an agent's watch cost (`make bench`: the SDK with the
operator on). With `batch_s`, a reader that woke less than `batch_s` ago waits out the rest
before it blocks again, then reads everything that came meanwhile at once: at most one
wake-up per `batch_s`, and no event later for it than `batch_s`. The first event after a
quiet spell is read at once, and so is what a reader that falls behind (a streaming list of a
deep queue) has not read yet: batching never slows a stream down.

The chunks are read off the connection's own buffered socket file (http.client's, under
urllib3's response), whose headers urllib3 has read: http.client reads a chunk at a time and
cannot say whether more has arrived. The connection is never reused afterwards.
"""

from __future__ import annotations

import select
import threading
import time
from collections.abc import Iterator
from typing import Any

import urllib3

from tasklease.api import errors

_READ = 65536
# Read at one wake-up at most: a streaming list of a deep queue keeps arriving, and its
# events must go on being delivered while it does.
_BATCH_BYTES = 1 << 20


class _Body:
    """The raw (still chunked) body of `resp`: reads that block, and whether one would not."""

    def __init__(self, resp: urllib3.BaseHTTPResponse) -> None:
        response: Any = getattr(resp, "_fp", None)  # http.client's response, past its headers
        sock: Any = getattr(getattr(resp, "connection", None), "sock", None)
        if response is None or sock is None or not getattr(response, "chunked", False):
            raise errors.ServerError("the API server's watch response is not a chunked stream")
        self._file = response.fp
        self._sock = sock
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)

    def read(self) -> bytes:
        """What has arrived, waiting for something if nothing has; b"" when the server closed."""
        data: bytes = self._file.read1(_READ)
        return data

    def more(self) -> bool:
        """A `read` now would not wait: bytes already decrypted, or arrived on the socket."""
        pending = getattr(self._sock, "pending", None)
        return bool(pending is not None and pending()) or bool(self._poll.poll(0))


def lines(resp: urllib3.BaseHTTPResponse, *, batch_s: float = 0.0,
          stop: threading.Event | None = None) -> Iterator[bytes]:
    """The non-blank lines of `resp`'s chunked body (one watch event each), until its last
    chunk, or until `stop` is set while waiting out a batch. A connection closed before the
    last chunk is `errors.Unreachable`; a read timeout is the socket's `TimeoutError`."""
    body = _Body(resp)
    framed = bytearray()  # as read: chunk sizes and chunks
    text = bytearray()  # the chunks' contents: lines, the last one maybe not whole yet
    woke = float("-inf")
    behind = False  # the last wake-up left bytes unread: read on at once
    while True:
        if batch_s > 0 and not behind:
            wait = woke + batch_s - time.monotonic()
            if wait > 0 and stop is None:
                time.sleep(wait)
            elif wait > 0 and stop.wait(wait):  # type: ignore[union-attr]
                return
        data = body.read()
        woke = time.monotonic()
        if not data:
            raise errors.Unreachable("watch interrupted: the API server closed the connection")
        framed += data
        while len(framed) < _BATCH_BYTES and body.more() and (data := body.read()):
            framed += data
        behind = len(framed) >= _BATCH_BYTES
        last = _unchunk(framed, text)
        start = 0
        while (end := text.find(b"\n", start)) >= 0:
            line = bytes(text[start:end])
            start = end + 1
            if line.strip():
                yield line
        del text[:start]
        if last:
            return


def _unchunk(framed: bytearray, text: bytearray) -> bool:
    """Move every whole chunk of `framed` into `text`; whether the last (empty) chunk came."""
    at = 0
    try:
        while (eol := framed.find(b"\r\n", at)) >= 0:
            size = int(bytes(framed[at:eol]).split(b";", 1)[0], 16)
            if size == 0:
                return True
            end = eol + 2 + size
            if len(framed) < end + 2:
                break
            text += framed[eol + 2:end]
            at = end + 2
    except ValueError:
        raise errors.ServerError("the API server's watch response is not valid chunked encoding") from None
    finally:
        del framed[:at]
    return False

"""The body of a chunked HTTP/1.1 response, decoded from its bytes as they arrive (pure, no I/O).

A watch reads its response through this, not through http.client's own decoding, which reads
a chunk per call (an event, for the API server) and keeps bytes read ahead where the reader
cannot see them: here every byte read is the reader's, so it knows when nothing is left to
read but what the socket has (`Kube.watch` waits then), and reads all that has arrived at once.
"""

from __future__ import annotations

_CRLF = b"\r\n"
_MAX_SIZE_LINE = 1024  # a chunk's size line, with any extensions: no server sends more


class MalformedChunk(ValueError):
    """The bytes are not a chunked body."""


class Dechunker:
    """`feed` it the body's bytes in any pieces; it returns the data they carry. `ended` once the
    last chunk and the trailer that follows it have been read; bytes after that are ignored."""

    def __init__(self) -> None:
        self._pending = b""  # an incomplete size or trailer line, or a split CRLF after data
        self._left = 0  # data bytes of the current chunk still to come
        self._after_data = False  # the CRLF that ends a chunk's data is next
        self._trailer = False  # the last chunk was read: trailer lines until an empty one
        self.ended = False

    def feed(self, data: bytes) -> bytes:
        if self._pending:
            data, self._pending = self._pending + data, b""
        out: list[bytes] = []
        pos, size = 0, len(data)
        while pos < size and not self.ended:
            if self._left:
                end = min(size, pos + self._left)
                out.append(data[pos:end])
                self._left -= end - pos
                self._after_data = not self._left
                pos = end
                continue
            if self._after_data:
                if size - pos < 2:
                    self._pending = data[pos:]
                    break
                if data[pos:pos + 2] != _CRLF:
                    raise MalformedChunk("a chunk's data is not followed by CRLF")
                self._after_data = False
                pos += 2
                continue
            end = data.find(_CRLF, pos)
            if end < 0:
                if size - pos > _MAX_SIZE_LINE:
                    raise MalformedChunk("a chunk's size line is too long")
                self._pending = data[pos:]
                break
            line, pos = data[pos:end], end + 2
            if self._trailer:
                self.ended = not line
                continue
            try:
                length = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise MalformedChunk(f"not a chunk size: {line[:40]!r}") from None
            if length < 0:
                raise MalformedChunk(f"not a chunk size: {line[:40]!r}")
            self._left = length
            self._trailer = length == 0
        return b"".join(out)

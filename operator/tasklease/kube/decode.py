"""Read what the API server sends, however deeply it nests.

The API server stores objects nested up to about 10,000 levels; Python's json reads far
fewer (on 3.12, about 1,400, whatever the recursion limit). An object it cannot read must
not stop a list or a watch (every reader of the queue would stop with it): what nests
deeper than `KEPT_DEPTH` is replaced by the string `TOO_DEEP`. Such an object is still
refused where its depth matters (a payload deeper than `models.MAX_PAYLOAD_DEPTH` is invalid).
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

# Deeper than any valid object, well within what json reads on 3.11 to 3.13.
KEPT_DEPTH: Final = 256
TOO_DEEP: Final = "<nested too deeply>"
_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)  # strings (skipped whole) and brackets


def loads(data: bytes | str) -> Any:
    try:
        return json.loads(data)
    except RecursionError:
        raw = data.encode() if isinstance(data, str) else data
        return json.loads(flatten(raw, KEPT_DEPTH))


def flatten(data: bytes, depth: int) -> bytes:
    """`data` (valid JSON) with every object or array nested deeper than `depth` replaced by `TOO_DEEP`."""
    out: list[bytes] = []
    level, kept_from, cut = 0, 0, 0  # cut: the level of the container being replaced, 0 for none
    for match in _TOKENS.finditer(data):
        token = match.group()
        if token[:1] == b'"':
            continue
        if token in (b"{", b"["):
            level += 1
            if level > depth and not cut:
                out.append(data[kept_from:match.start()])
                cut = level
        else:
            if level == cut:
                out.append(json.dumps(TOO_DEEP).encode())
                kept_from, cut = match.end(), 0
            level -= 1
    out.append(data[kept_from:])
    return b"".join(out)

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
from collections.abc import Iterator
from typing import Any, Final

import pydantic_core

# Deeper than any valid object, well within what json reads on 3.11 to 3.13.
KEPT_DEPTH: Final = 256
TOO_DEEP: Final = "<nested too deeply>"
_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)  # strings (skipped whole) and brackets
_BLANK = frozenset(" \t\n\r")
_DECODER = json.JSONDecoder()


def loads(data: bytes | str) -> Any:
    # pydantic's own parser first, the faster: every agent of a queue decodes every event of
    # its Tasks. What it refuses (nesting past its limit, which is below `KEPT_DEPTH`, or
    # invalid JSON) is read as json reads it, with json's errors.
    try:
        return pydantic_core.from_json(data)
    except ValueError:
        pass
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


def loads_page(data: bytes) -> dict[str, Any]:
    """A LIST answer whose `items` are decoded one at a time, as they are iterated: a page of
    a deep queue never exists decoded all at once (what is kept of each item is then not
    scattered among the page's garbage). `items` is an iterator; the keys that follow it in
    the answer (a custom resource's `metadata`, with the `continue` token) are there once it
    has been iterated to its end. Read as `loads` reads: an item too deep for json is cut."""
    text = data.decode(json.detect_encoding(data), "surrogatepass")  # as json.loads reads bytes
    page: dict[str, Any] = {}
    walk = _walk(text, page)
    if next(walk, None) is not None:  # at the items, which the walk yields from now on
        page["items"] = walk
    return page


def _walk(text: str, page: dict[str, Any]) -> Iterator[Any]:
    """Fill `page` with the top-level object of `text`; at a key `items` holding an array, yield
    True, then each item, then go on. What json cannot read this way is read by `loads`."""
    reached, yielded = False, 0
    try:
        at = _skip(text, 0)
        if text[at:at + 1] != "{":
            raise ValueError("not an object")
        at = _skip(text, at + 1)
        while text[at:at + 1] != "}":
            key, at = _DECODER.raw_decode(text, at)
            at = _skip(text, at)
            if not isinstance(key, str) or text[at:at + 1] != ":":
                raise ValueError("not a key")
            at = _skip(text, at + 1)
            if key == "items" and text[at:at + 1] == "[":
                reached = True
                yield True
                at = _skip(text, at + 1)
                while text[at:at + 1] != "]":
                    item, at = _DECODER.raw_decode(text, at)
                    yielded += 1
                    yield item
                    at = _skip(text, at)
                    if text[at:at + 1] == ",":
                        at = _next(text, at)
                    elif text[at:at + 1] != "]":
                        raise ValueError("no comma between items")
                at += 1
            else:
                page[key], at = _DECODER.raw_decode(text, at)
            at = _skip(text, at)
            if text[at:at + 1] == ",":
                at = _next(text, at)
            elif text[at:at + 1] != "}":
                raise ValueError("no comma between keys")
        if _skip(text, at + 1) != len(text):
            raise ValueError("more after the answer")
    except (ValueError, RecursionError):
        whole = loads(text)  # too deep: cut as `loads` cuts; invalid: its error
        if not isinstance(whole, dict):
            raise ValueError("a LIST answer that is not an object") from None
        items = whole.pop("items", None) if reached or isinstance(whole.get("items"), list) else None
        page.update(whole)
        if not reached and items is not None:
            yield True
        yield from (items or [])[yielded:]


def _next(text: str, at: int) -> int:
    """Past the comma at `at`, at what follows it: something, not the end of its container."""
    at = _skip(text, at + 1)
    if text[at:at + 1] in ("]", "}", ""):
        raise ValueError("a comma before the end")
    return at


def _skip(text: str, at: int) -> int:
    """Past the whitespace at `at` (the API server sends none; JSON allows it)."""
    while text[at:at + 1] in _BLANK:
        at += 1
    return at

"""A queue's open Tasks read best first, a few pages at a time: strict priority without reading the queue.

The one-shot claim (`tasklease claim`) keeps no index: it must find the highest band from the
API server. Field selectors only compare for equality, but label selectors compare integers
(`key>N`, `key<N`), so producers label each Task with its rank (`LABEL_RANK`: the priority plus
`OFFSET`, as a label value cannot be negative), and a few short LISTs climb to the top band
(`_top`). The label is a hint and nothing more: tasks are ranked by the `spec.priority` of the
objects read, and the claim checks the Task and its Lease as always. A task without the label
(created by hand, say) is read whole, every time (`!rank`); one whose label is no rank (no integer, or
above the highest priority) is left to the watching agents.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Final

from tasklease.api import models
from tasklease.kube import JSON, TASKS, Kube

LABEL_RANK: Final = "tasklease.dev/rank"
_PRIORITY: Final = models.TaskSpec.model_json_schema(by_alias=True)["properties"]["priority"]
OFFSET: Final = -int(_PRIORITY["minimum"])
_CAP: Final = int(_PRIORITY["maximum"]) + OFFSET + 1  # above every rank
_DEFAULT_PRIORITY: Final = int(_PRIORITY["default"])


def rank(priority: int) -> str:
    """The label value of a task of `priority`."""
    return str(priority + OFFSET)


def labelled(task: JSON) -> JSON:
    """`task` (a body to create) with its rank label, unless it has one already."""
    meta = task.get("metadata") or {}
    labels = meta.get("labels") or {}
    if LABEL_RANK in labels:
        return task
    priority = (task.get("spec") or {}).get("priority", _DEFAULT_PRIORITY)
    if not isinstance(priority, int) or isinstance(priority, bool):
        return task  # the API server refuses it with a clear message; not ours to guess
    return {**task, "metadata": {**meta, "labels": {**labels, LABEL_RANK: rank(priority)}}}


def best_key(task: JSON) -> tuple[int, str, str]:
    """Best first: higher priority, then older, then by name."""
    meta = task["metadata"]
    return (-int((task.get("spec") or {}).get("priority", _DEFAULT_PRIORITY)), meta.get("creationTimestamp", ""),
            meta["name"])


def best_first(kube: Kube, *, namespace: str, field_selector: str, page: int) -> Iterator[JSON]:
    """The Tasks `field_selector` selects, highest priority first (strict across the queue),
    oldest first within what one page of a band shows; read lazily, band by band, a page at a
    time: a caller that stops at the first task it can claim reads a few short pages."""
    loose = deque(sorted((task for listed in kube.list_pages(TASKS, namespace=namespace, field_selector=field_selector,
                                                       label_selector=f"!{LABEL_RANK}", limit=page)
                          for task in listed.get("items", [])), key=best_key))
    ceiling: int | None = None  # the bands left are below this rank
    while True:
        top = _top(kube, namespace=namespace, field_selector=field_selector, page=page, below=ceiling)
        # The unlabelled ones of this band or a higher one come first.
        while loose and (top is None or -best_key(loose[0])[0] + OFFSET >= top):
            yield loose.popleft()
        if top is None:
            return
        for listed in kube.list_pages(TASKS, namespace=namespace, field_selector=field_selector,
                                      label_selector=f"{LABEL_RANK}={top}", limit=page):
            yield from sorted(listed.get("items", []), key=best_key)
        ceiling = top


def _top(kube: Kube, *, namespace: str, field_selector: str, page: int, below: int | None) -> int | None:
    """The highest rank below `below` (None: any) of a selected task; None when there is none.
    Each LIST asks for a rank above the best seen so far: one more than the bands there are
    above the first page's best, and usually two in all."""
    bound = f"{LABEL_RANK}<{_CAP if below is None else below}"
    selector, best = bound, None
    while True:
        ranks = [_int(task) for task in kube.list(TASKS, namespace=namespace, field_selector=field_selector,
                                                  label_selector=selector, limit=page).get("items", [])]
        higher = [r for r in ranks if r is not None and (best is None or r > best)]
        if not higher:
            return best
        best = max(higher)
        selector = f"{LABEL_RANK}>{best},{bound}"


def _int(task: JSON) -> int | None:
    try:
        return int(((task.get("metadata") or {}).get("labels") or {}).get(LABEL_RANK, ""))
    except ValueError:
        return None

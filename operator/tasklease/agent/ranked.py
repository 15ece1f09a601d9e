"""A queue's open Tasks read best first, a few pages at a time: strict priority without reading the queue.

The one-shot claim (`tasklease claim`) keeps no index: it must learn the highest band from the
API server. Field selectors only compare for equality, but label selectors compare integers
(`key>N`, `key<N`) and select objects without a key (`!key`), so each Task is labelled with
its rank (`protocol.labels`: the priority plus an offset, as a label value cannot be
negative). The label is a hint and nothing more: a task without it (created by hand, before
the operator labels it) is read whole and ranked by its `spec.priority`, tasks are ordered
by the `spec.priority` of the objects read, and the claim checks the Task and its Lease as
always. A task whose label is no integer is left to the watching agents; a priority changed
after creation keeps the rank it was created with until the operator labels it again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from typing import Final

from tasklease.kube import JSON, TASKS, Kube
from tasklease.protocol.labels import DEFAULT_PRIORITY, DEFAULT_RANK, LABEL_RANK, OFFSET, TOP_RANK

_CAP: Final = TOP_RANK + 1  # above every rank
# Not older than the first revision: whatever the watch cache holds now, at once, a page at a
# time (`resourceVersion=0` would serve the same, but every selected Task in one answer).
ANY_VERSION: Final = "1"


def best_key(task: JSON) -> tuple[int, str, str]:
    """Best first: higher priority, then older, then by name."""
    meta = task["metadata"]
    return (-int((task.get("spec") or {}).get("priority", DEFAULT_PRIORITY)), meta.get("creationTimestamp", ""),
            meta["name"])


def best_first(kube: Kube, *, namespace: str, field_selector: str, page: int, beside: Executor,
               fresh: bool) -> Iterator[JSON]:
    """The Tasks `field_selector` selects, highest priority first (strict across the queue),
    oldest first within what a page of a band shows; read lazily, band by band, a page at a
    time. A caller that stops at the first task it can claim makes two LISTs at once: the
    first page, and one page of every task outside the default priority's band (no label,
    another rank), usually short. Only when that is more than a page does it take one more,
    of every task outside the first page's best band, and when that too is more than a page,
    two more, of the tasks that could go first (no label, a higher rank). Those after the
    first two (and the pages of a band read on) are served by the API server's watch cache
    once it is at least as fresh as the first page (`not_older_than`), so they see every task the
    first page's snapshot holds: the order is strict over every task that existed when the
    claim began. `beside` reads the second of the two LISTs while this thread reads the first.

    `fresh=False`: the first two are served by the watch cache as it is, not as fresh as
    etcd (`ANY_VERSION`), and the order is strict over what the cache held then. For a look
    whose claim is checked anyway and which the agent's own list follows: a consistent read
    waits for the cache to reach etcd's newest revision, and while many agents list a deep
    queue at once the cache falls behind, the read falls back to etcd, and there times out."""
    # Asked beside the first page, as most tasks have the default priority: the tasks outside its
    # band. The API server scans the whole namespace for a selection that fills no page, so one
    # scan finds what is outside a band (`!=` selects a task without the label too); a guess
    # that is wrong fills its page at once.
    start = "" if fresh else ANY_VERSION
    guess = beside.submit(kube.list, TASKS, namespace=namespace, field_selector=field_selector,
                          label_selector=f"{LABEL_RANK}!={DEFAULT_RANK}", limit=page, not_older_than=start)
    listing = kube.list(TASKS, namespace=namespace, field_selector=field_selector, limit=page, not_older_than=start)
    outside_default = guess.result()
    first = listing.get("items", [])
    if not first:
        return
    version = (listing.get("metadata") or {}).get("resourceVersion", "")
    since = functools.partial(kube.list, TASKS, namespace=namespace, field_selector=field_selector,
                              not_older_than=version)
    pool = {task["metadata"]["name"]: task for task in first}
    # The band read in part: the default one when every task outside it was read beside the
    # first page, else the best of the first page (the bands below it are partly read too).
    if not (outside_default.get("metadata") or {}).get("continue"):
        seen = DEFAULT_RANK
        others = outside_default
    else:
        seen = max(_rank_of(task) for task in first)
        others = outside_default if seen == DEFAULT_RANK else since(label_selector=f"{LABEL_RANK}!={seen}", limit=page)
    pool.update((task["metadata"]["name"], task) for task in others.get("items", []))
    whole = not (others.get("metadata") or {}).get("continue")  # every task outside the band is read
    if not whole:  # many in other bands: only those that could go before this one
        higher = [f"{LABEL_RANK}>{seen}"] if seen < _CAP - 1 else []  # none above the highest priority
        for labels in (f"!{LABEL_RANK}", *higher):
            pool.update((task["metadata"]["name"], task) for task in since(label_selector=labels).get("items", []))
    # The band read in part has more tasks than the pool holds when the first page had more after it.
    unread = [seen] if (listing.get("metadata") or {}).get("continue") else []
    ceiling = _CAP  # the bands left are below this rank
    while True:
        band = max((r for r in (*map(_rank_of, pool.values()), *unread) if r < ceiling), default=None)
        if ceiling <= seen and not whole:  # labelled tasks below the first page's best band were not read
            labelled = _top(since, page=page, below=ceiling)
            band = max((r for r in (band, labelled) if r is not None), default=None)
        if band is None:
            return
        given = set()
        for task in sorted((t for t in pool.values() if _rank_of(t) == band), key=best_key):
            given.add(task["metadata"]["name"])
            yield task
        if band == seen or (band < seen and not whole):  # the band was read in part
            for found in kube.list_pages(TASKS, namespace=namespace, field_selector=field_selector,
                                         label_selector=f"{LABEL_RANK}={band}", limit=page, not_older_than=version):
                yield from sorted((t for t in found.get("items", []) if t["metadata"]["name"] not in given),
                                  key=best_key)
        ceiling = band


def _top(since: Callable[..., JSON], *, page: int, below: int | None) -> int | None:
    """The highest rank below `below` (None: any) of a selected task; None when there is none.
    Each LIST asks for a rank above the best seen so far: one more than the bands there are
    above the first page's best, and usually two in all."""
    bound = f"{LABEL_RANK}<{_CAP if below is None else below}"
    selector, best = bound, None
    while True:
        ranks = [_int(task) for task in since(label_selector=selector, limit=page).get("items", [])]
        higher = [r for r in ranks if r is not None and (best is None or r > best)]
        if not higher:
            return best
        best = max(higher)
        selector = f"{LABEL_RANK}>{best},{bound}"


def _rank_of(task: JSON) -> int:
    """Its rank label when that is a rank, else the rank of its `spec.priority`."""
    try:
        labelled = int(((task.get("metadata") or {}).get("labels") or {}).get(LABEL_RANK, ""))
    except ValueError:
        labelled = -1
    if 0 <= labelled < _CAP:
        return labelled
    priority = (task.get("spec") or {}).get("priority", DEFAULT_PRIORITY)
    return priority + OFFSET if isinstance(priority, int) else OFFSET


def _int(task: JSON) -> int | None:
    try:
        return int(((task.get("metadata") or {}).get("labels") or {}).get(LABEL_RANK, ""))
    except ValueError:
        return None

"""`tasklease pause QUEUE` and `tasklease resume QUEUE`: set a TaskQueue's spec.paused.

Pausing a queue without a TaskQueue creates one (named as the queue, nothing else set);
resuming one without a TaskQueue has nothing to do. Running tasks go on either way:
agents stop claiming, and the operator takes back a claim made while paused (docs/queues.md).
"""

from __future__ import annotations

import argparse
import contextlib

from tasklease.api import errors, models, queues
from tasklease.cli.common import kube_of
from tasklease.kube import NAMESPACES, TASKQUEUES, Kube


def set_paused(kube: Kube, queue: str, *, paused: bool) -> str:
    """What changed, in one line."""
    where = f"queue {queue} (namespace {kube.namespace})"
    if kube.get_or_none(TASKQUEUES, queue) is None:
        if not paused:
            with contextlib.suppress(errors.Forbidden):  # we may not look: nothing to resume, then
                if kube.get_or_none(NAMESPACES, kube.namespace) is None:  # as pause's create would say
                    raise errors.NotFound(f"namespace {kube.namespace!r} does not exist")
            return f"{where} has no TaskQueue: it is not paused"
        try:
            kube.create(TASKQUEUES, {"apiVersion": f"{models.GROUP}/{models.VERSION}", "kind": queues.QUEUE_KIND,
                                     "metadata": {"name": queue}, "spec": {"paused": True}})
            return f"{where} paused (TaskQueue created)"
        except errors.Conflict:
            pass  # made meanwhile: set it below
    kube.merge_patch(TASKQUEUES, queue, {"spec": {"paused": paused}})
    return f"{where} {'paused' if paused else 'resumed'}"


def cmd_pause(args: argparse.Namespace) -> int:
    print(set_paused(kube_of(args), args.queue, paused=True))
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    print(set_paused(kube_of(args), args.queue, paused=False))
    return 0

"""A Task's labels, which its watches and reads select by: its shard and its rank.

A shard (`LABEL_SHARD`, one of `SHARDS`, a hash of the task's name) says which agents watch
the task (`agent.division.viewers`: two per shard), so that what the operator writes to it
wakes two agents, not the whole queue. A rank (`LABEL_RANK`: the priority plus `OFFSET`, as a
label value cannot be negative) lets a read select a band (label selectors compare integers)
and lets agents watch the default band apart from the others. Producers label what they
create (`labelled`); the operator labels a Task that arrives without them, or whose rank no
longer says its priority (`relabelled`). Labels are hints: every decision reads the Task.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from typing import Final

from tasklease.api import models
from tasklease.kube import JSON

LABEL_SHARD: Final = "tasklease.dev/shard"
SHARDS: Final = 64  # part of the protocol: producers label with it, agents watch by it
LABEL_RANK: Final = "tasklease.dev/rank"
_PRIORITY: Final = models.TaskSpec.model_json_schema(by_alias=True)["properties"]["priority"]
OFFSET: Final = -int(_PRIORITY["minimum"])
DEFAULT_PRIORITY: Final = int(_PRIORITY["default"])
DEFAULT_RANK: Final = DEFAULT_PRIORITY + OFFSET
TOP_RANK: Final = int(_PRIORITY["maximum"]) + OFFSET  # the highest priority's


def shard_of(name: str) -> int:
    """The shard a producer labels a task named `name` with (the same on every create)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big") % SHARDS


def shard_label(labels: Mapping[str, str] | None) -> int | None:
    """The shard `labels` put a task in; None for none or a value that is not one (such a
    task is watched by every agent, as one created without the label)."""
    value = (labels or {}).get(LABEL_SHARD, "")
    return int(value) if value.isdigit() and int(value) < SHARDS and str(int(value)) == value else None


def rank(priority: int) -> str:
    """The label value of a task of `priority`."""
    return str(priority + OFFSET)


def labelled(task: JSON) -> JSON:
    """`task` (a body to create) with its rank label and its shard label, unless it has them
    already. A task created without a name (the API server generates one) is given a shard at
    random: any shard is as good, once."""
    meta = task.get("metadata") or {}
    labels = dict(meta.get("labels") or {})
    if LABEL_SHARD not in labels:
        name = meta.get("name")
        labels[LABEL_SHARD] = str(shard_of(name) if isinstance(name, str) else random.randrange(SHARDS))
    priority = (task.get("spec") or {}).get("priority", DEFAULT_PRIORITY)
    if LABEL_RANK not in labels and isinstance(priority, int) and not isinstance(priority, bool):
        # Else the API server refuses it with a clear message; not ours to guess.
        labels[LABEL_RANK] = rank(priority)
    return {**task, "metadata": {**meta, "labels": labels}}


def relabelled(task: JSON) -> dict[str, str]:
    """The labels the stored Task `task` lacks or has wrong, as the operator writes them: a
    shard where it has none that is valid (kept otherwise: moving a task between shards
    would move it between agents for nothing), and the rank of its priority now."""
    meta = task.get("metadata") or {}
    labels = meta.get("labels") or {}
    wanted: dict[str, str] = {}
    if shard_label(labels) is None and isinstance(meta.get("name"), str):
        wanted[LABEL_SHARD] = str(shard_of(meta["name"]))
    priority = (task.get("spec") or {}).get("priority", DEFAULT_PRIORITY)
    if isinstance(priority, int) and not isinstance(priority, bool) and labels.get(LABEL_RANK) != rank(priority):
        wanted[LABEL_RANK] = rank(priority)
    return wanted

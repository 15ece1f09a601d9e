"""How the agents of a queue divide its tasks: rendezvous hashing (pure, no I/O).

Each task belongs to the agent that weighs it highest (`owner`); agents that know the same
peers never race for a task while each has one of its own. A task is taken from its owner
(stolen) only by an agent that has none, busy owners first, the task's deputy first
(`divide`).

A task labelled with a shard (`protocol.labels`) is divided among its
shard's viewers only (`viewers`): the two agents that watch it. Every other agent's watch
leaves it out, so what the operator writes to it wakes two agents, not the whole queue.
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Final

from tasklease.protocol.labels import SHARDS

VIEWERS: Final = 2  # per shard: its tasks' owner and deputy


def weight(holder: str, name: str) -> float:
    """`holder`'s rendezvous weight for task `name`, in [0, 1): the same on every look."""
    digest = hashlib.blake2b(f"{holder}\0{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def viewers(peers: Collection[str]) -> tuple[frozenset[str], ...]:
    """Who watches each shard among `peers`: `VIEWERS` of them (all, when fewer), by
    rendezvous weight, none watching more than its fair part and one (two at most, when a
    shard's viewers must differ), so that the agents' shares stay even. The same on every agent
    that knows the same peers; a peer that comes or goes moves its own shards and a few more."""
    if len(peers) <= VIEWERS:
        return (frozenset(peers),) * SHARDS
    # One bound for every shard, not one that grows shard by shard: a change of peers then
    # moves few shards besides those of the peer that came or went (each moved shard is
    # listed again by its new viewer).
    fair = SHARDS * VIEWERS / len(peers)
    cap = math.ceil(fair) + 1
    load: Counter[str] = Counter()
    found = []
    for shard in range(SHARDS):
        # Those that would end short of their part without every shard left first, then the
        # heaviest among those under the bound, then the least loaded of the others.
        ranked = sorted(peers, key=lambda p: (load[p] + SHARDS - shard > fair - 1, load[p] >= cap,
                                              load[p] if load[p] >= cap else 0, -weight(p, f"shard/{shard}"), p))
        found.append(frozenset(ranked[:VIEWERS]))
        load.update(ranked[:VIEWERS])
    return tuple(found)


Ownership = tuple[float, str, str]  # (the owner's weight, the owner, its deputy or "")


def owner(peers: Iterable[str], name: str) -> Ownership:
    """Who task `name` belongs to among `peers`: the one that weighs it highest; and its
    deputy, the next one, which is the first to take it from an owner that does not."""
    # The top two in one pass (every agent computes this for every task that reaches its window).
    first = second = (-1.0, "")
    for peer in peers:
        entry = (weight(peer, name), peer)
        if entry > first:
            first, second = entry, first
        elif entry > second:
            second = entry
    return first[0], first[1], second[1]


def owned_weight(me: str, peers: Iterable[str], name: str) -> float | None:
    """`me`'s weight for task `name` when `me` owns it among `peers` (as `owner` says); None
    as soon as one peer weighs it higher. Most tasks are another's, and a few hashes then
    decide instead of one per peer: at 16 agents, hashing every peer for every task in the
    window was the largest part of a look."""
    mine = (weight(me, name), me)
    for peer in peers:
        if peer != me and (weight(peer, name), peer) > mine:
            return None
    return mine[0]


class Owner(enum.IntEnum):
    """What the owner of another agent's task is doing, in the order a thief takes from it."""

    BUSY = 0  # holds a lease and is not claiming: long work, it will not take more soon
    IDLE = 1  # holds nothing and is not claiming: it takes its task now, if it is alive
    CLAIMING = 2  # taking its own: only the far end of a backlog it has in our view (`QueueView._tail`)


@dataclass(frozen=True)
class Division:
    """One look's candidates divided among the agents at work (rendezvous hashing): each
    task belongs to the agent that weighs it highest. Agents that know the same peers never
    race for a task while each has one of its own; a task is taken from its owner (stolen)
    only by an agent that has none, and never from an owner that is claiming (its tasks
    are not candidates to its peers: `QueueView` parks them)."""

    names: list[str]  # best first: ours in our weight order or, if none is ours, the others' (`divide`)
    ours: int  # how many are ours: all of `names`, or none
    owner: Owner | None  # when none is ours: what the owner of the first is doing
    deputy: bool = False  # when none is ours: we are the first's deputy, the first thief in line
    # When none may be taken now: how soon to look again (a new task ripens, `_RIPE_S`, or a
    # claiming owner would be gone, were it silent), unless something changes first.
    wait_s: float = 0.0
    held_back: bool = False  # none may be taken: a higher band is left to claiming peers


def divide(me: str, names: list[str], owners: Callable[[str], Ownership], busy: Collection[str] = ()) -> Division:
    """Divide `names` (one band's oldest) between `me` and the peers `owners` names. When
    none is ours, the others' come in the order a thief should take them (`Owner`), ours
    as deputy first, then by our weight, so that thieves too spread out."""
    ours: list[tuple[float, str]] = []  # (our weight, name): an owner's weight is the top one
    others: list[tuple[str, str, str]] = []  # (name, its owner, its deputy)
    for name in names:
        top, peer, deputy = owners(name)
        if peer == me:
            ours.append((top, name))
        else:
            others.append((name, peer, deputy))
    if ours:
        ours.sort(reverse=True)
        return Division(names=[name for _, name in ours], ours=len(ours), owner=None)
    # Only now our weight for the others': most looks find some of their own (a hash each saved).
    later = sorted((Owner.BUSY if peer in busy else Owner.IDLE, deputy != me, -weight(me, name), name)
                   for name, peer, deputy in others)
    return Division(names=[entry[3] for entry in later], ours=0, owner=later[0][0] if later else None,
                    deputy=bool(later) and not later[0][1])

"""A member Lease: one agent telling the other agents of a queue that it works there, and what it took.

Agents divide a queue's tasks among the agents at work (rendezvous hashing, in the agent's
`discovery`), so each must know its peers; and a thief must know what its peers took.
Watching every task Lease would tell both, at the price of every claim and every completion
reaching every agent of the queue (at 16 agents, 32 deliveries per task, which cost more
than the task's own writes). Instead each agent at work keeps a member Lease of its own:

- `holderIdentity`: the agent; none means it left.
- `tasklease.dev/claiming`: "true" while it is taking its own tasks (it claimed within
  `QUIET_S`): its peers leave its share to it, and need not hear of each claim it makes.
  A task its peers leave to it holds back their lower bands (strict priority): it tells
  at once when it moves to a lower band than a claim it has not told, or is held back.
- `tasklease.dev/took`: tasks it claimed by creating their Lease (which its peers do not
  watch) and had not told of yet, nor seen the operator tell of (a Task projected Running,
  or finished, is known taken to every agent). A member tells when it stops claiming, when
  it leaves, at once for a task it took from another member, when a peer joins (its share
  moves to the newcomer in part), as above, and every `TELL_MAX` claims: not once per
  claim, nor once a second while it claims, which at 16 agents cost more than the tasks'
  own writes.
- `tasklease.dev/holding`: how many leases it holds: a thief takes from busy agents first.
- `tasklease.dev/waiting`: "true" while a claim of its has waited for a task for a while
  (`WAITING_S`): it takes its shards' tasks as they come, so a peer whose own shards hold
  nothing need not read them. A member that neither claims nor waits (an SDK user between
  claims, or one busy with what it holds) takes none: its peers read the queue for them.
  Unlike `claiming`, it keeps nothing parked for the member. Optional: absent means "false".
- `leaseDurationSeconds`: a member not seen written for that long is gone.

Member Leases are not task Leases: labelled `tasklease.dev/agent-of=<queue>`, never
`app.kubernetes.io/managed-by=tasklease`, so the operator and the task watches never see
them. Only its agent writes one (the chart's admission policy, `policy`, refuses any other
writer and bounds what it says), so a write is conditional on the agent's own last
resourceVersion. In a Pod a member Lease is owned by the Pod and goes with it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Final

from tasklease.api import errors, timestamps
from tasklease.api.timestamps import format_time
from tasklease.kube import JSON, LEASES, Kube
from tasklease.protocol.record import label_value

LABEL_AGENT_OF: Final = "tasklease.dev/agent-of"
ANN_TOOK: Final = "tasklease.dev/took"
ANN_CLAIMING: Final = "tasklease.dev/claiming"
ANN_HOLDING: Final = "tasklease.dev/holding"
ANN_WAITING: Final = "tasklease.dev/waiting"
DURATION_S: Final = 10
# A member that claimed nothing for this long stops claiming: it tells what it took, and its
# peers may take its share (long work keeps it away, or it has stopped). Longer than most
# tasks: a member doing tasks of a few seconds stays claiming, and writes nothing per task.
QUIET_S: Final = 5.0
# A claiming member tells once it has this many untold claims: its annotation stays small.
TELL_MAX: Final = 256
# A claim taken from another member's share (a theft) is told this long after it, unless the
# operator's projection told it first: its owner and the other thieves would race for it, but
# the projection usually reaches them sooner, at no write of the thief's.
THEFT_TELL_S: Final = 1.0
# A claim that has waited this long for a task says so (`ANN_WAITING`); shorter waits, a claim
# lost to a peer at work, say nothing: a busy queue's members write nothing per claim.
WAITING_S: Final = 1.0


def selector(queue: str) -> str:
    return f"{LABEL_AGENT_OF}={label_value(queue)}"


def retire(kube: Kube, lease: JSON) -> None:
    """Say, for the agent of member Lease `lease` (known gone: an earlier instance of our pod),
    that it left: its peers divide its share at once, instead of leaving it to an agent that
    claims no more until its Lease runs out. Conflict if it was written meanwhile."""
    meta = lease["metadata"]
    kube.merge_patch(LEASES, meta["name"], {
        "metadata": {"resourceVersion": meta["resourceVersion"],
                     "annotations": _annotations([], 0, claiming=False, waiting=False)},
        "spec": {"holderIdentity": None}}, namespace=meta["namespace"], timeout=5)


def _annotations(took: list[str], holding: int, *, claiming: bool, waiting: bool) -> dict[str, str]:
    """Every annotation a member Lease carries, every time: a merge patch keeps what it does not name."""
    return {ANN_TOOK: json.dumps(took, separators=(",", ":")), ANN_HOLDING: str(holding),
            ANN_CLAIMING: "true" if claiming else "false", ANN_WAITING: "true" if waiting else "false"}


def lease_name(queue: str, holder: str) -> str:
    """A name no Task is likely to have (a task's Lease is named after its Task)."""
    return "tasklease-agent." + hashlib.blake2b(f"{queue}\0{holder}".encode(), digest_size=8).hexdigest()


@dataclass(frozen=True)
class Member:
    """What one member Lease says."""

    name: str
    holder: str  # "" once it left
    took: tuple[str, ...] = ()
    holding: int = 0
    claiming: bool = False
    waiting: bool = False
    duration_s: int = DURATION_S


def decode(lease: JSON) -> Member:
    meta, spec = lease["metadata"], lease.get("spec") or {}
    ann = meta.get("annotations") or {}
    try:
        took = tuple(str(n) for n in json.loads(ann.get(ANN_TOOK) or "[]"))
        holding = int(ann.get(ANN_HOLDING) or 0)
    except (ValueError, TypeError, RecursionError):  # edited by hand, or nested past the decoder: still a peer
        took, holding = (), 0
    return Member(name=meta["name"], holder=spec.get("holderIdentity") or "", took=took, holding=holding,
                  claiming=ann.get(ANN_CLAIMING) == "true", waiting=ann.get(ANN_WAITING) == "true",
                  duration_s=int(spec.get("leaseDurationSeconds") or DURATION_S))


class MemberLease:
    """One agent's member Lease in one queue. Not thread-safe: one writer, its agent's."""

    def __init__(self, kube: Kube, *, namespace: str, queue: str, holder: str,
                 pod: tuple[str, str] | None = None) -> None:
        """`pod`: (name, uid) of the Pod the agent runs in, which owns the Lease."""
        self._kube = kube
        self._namespace = namespace
        self._queue = queue
        self._holder = holder
        self._pod = pod
        self.name = lease_name(queue, holder)
        self._version = ""  # after our last write

    def write(self, took: list[str], holding: int, *, claiming: bool = False, waiting: bool = False,
              left: bool = False) -> bool:
        """Say we work the queue (or `left` it), holding `holding` leases, `claiming` or not,
        `waiting` in a claim or not, having taken `took` since the last write. False when the name
        belongs to a Lease that is not a member's (a Task named so): then this agent cannot tell its
        peers anything."""
        body = self._body(took, holding, claiming=claiming, waiting=waiting, left=left)
        if self._version:
            try:
                self._patch(body, self._version)
                return True
            except (errors.Conflict, errors.NotFound):  # deleted or edited by someone else
                self._version = ""
        if left:
            return True  # never written, or not ours any more: nothing to leave
        try:
            self._version = self._kube.create(LEASES, body, namespace=self._namespace,
                                              timeout=5)["metadata"]["resourceVersion"]
            return True
        except errors.Conflict:  # ours from a moment ago (an answer lost), or a Task's Lease of that name
            current = self._kube.get(LEASES, self.name, namespace=self._namespace, timeout=5)
        if (current["metadata"].get("labels") or {}).get(LABEL_AGENT_OF) != label_value(self._queue):
            return False
        self._patch(body, current["metadata"]["resourceVersion"])
        return True

    def delete(self) -> bool:
        """Delete our member Lease, conditional on our last write, which named us (the admission
        policy lets an agent delete only its own). False when we may not (a role without
        deletes): the caller then says we left (`write(..., left=True)`)."""
        if not self._version:
            return True
        try:
            self._kube.delete(LEASES, self.name, namespace=self._namespace,
                              preconditions={"resourceVersion": self._version})
        except (errors.NotFound, errors.Conflict):  # gone, or written by someone else since: not ours to end
            pass
        except errors.Forbidden:
            return False
        self._version = ""
        return True

    def _patch(self, body: JSON, version: str) -> None:
        """A merge patch conditional on `version`; remembers the version it makes."""
        # No managedFields kept, as on a task's Lease (`record.encode_patch` says why).
        conditional = {**body, "metadata": {**body["metadata"], "resourceVersion": version, "managedFields": []}}
        self._version = self._kube.merge_patch(LEASES, self.name, conditional, namespace=self._namespace,
                                               timeout=5)["metadata"]["resourceVersion"]

    def _body(self, took: list[str], holding: int, *, claiming: bool, waiting: bool, left: bool) -> JSON:
        meta: JSON = {"name": self.name, "labels": {LABEL_AGENT_OF: label_value(self._queue)},
                      "annotations": _annotations(took, holding, claiming=claiming and not left,
                                                  waiting=waiting and not left)}
        if self._pod is not None:
            meta["ownerReferences"] = [{"apiVersion": "v1", "kind": "Pod", "name": self._pod[0], "uid": self._pod[1],
                                        "blockOwnerDeletion": False}]
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta,
                "spec": {"holderIdentity": None if left else self._holder, "leaseDurationSeconds": DURATION_S,
                         "renewTime": format_time(timestamps.now_utc())}}

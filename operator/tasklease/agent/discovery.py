"""What an agent can claim in one queue: a candidate index kept current by server-filtered watches.

The API server selects what each agent downloads: its queue's open Tasks (`spec.queue`, a CRD
selectable field, and the phase; once listed, the watch selects the queue alone and its
Reflector leaves out the tasks that finish, see `queue_selector`), its queue's *free* Leases
only (`tasklease.dev/state=free`), and its queue's member Leases (`protocol.members`: who works
the queue, and what they took). A claim, a renewal or a completion of a task's Lease reaches no
other agent: a Lease that stops being free arrives as DELETED, which means exactly "no longer
claimable"; a task claimed by creating its Lease is learnt from the operator's projection of
its Task or, failing that, from its claimer's member Lease once it stops claiming, a batch of
names at a time. Agents divide the tasks among the members, so none needs to hear of each
claim: a claiming member's share leaves its peers' index (it is "parked") until it stops
claiming.

Each event re-judges one task with the one claimability rule (`rules.blocker`) and updates
the index in O(1) (`candidates`). No polling: a waiting agent sleeps until something becomes
claimable, a peer comes or goes, or the earliest backoff runs out.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import TypeVar

from tasklease.agent.candidates import CandidateIndex
from tasklease.agent.compact import compact, expand, same_task
from tasklease.agent.division import Division, Owner, Ownership, divide, owned_weight, owner, viewers
from tasklease.agent.taskwatch import TaskWatches
from tasklease.api import errors, models
from tasklease.api.timestamps import parse_time
from tasklease.kube import JSON, LEASES, Kube
from tasklease.kube.watching import Listener, Reflector
from tasklease.protocol import LeaseRecord, TaskView, members, record
from tasklease.protocol.labels import SHARDS
from tasklease.protocol.rules import Blocker, blocker

Candidate = tuple[TaskView, LeaseRecord | None]
K = TypeVar("K")
_SPREAD_PER_HOLDER = 8
# Another's task that became claimable without a Lease (new, or its start came) less than
# this ago may be its owner's already: an owner that was not claiming takes it at once and
# says it claims (one write, one watch event), but claimed by creating its Lease, which no
# watch of ours shows. (A claim of a free Lease reaches us at once: the Lease leaves our watch.)
_RIPE_S = 1.5
_EXPIRED = "Expired"  # the outcome of an attempt whose holder the operator found silent (`Protocol.expire`)
_DECODED = 1024  # task views kept decoded (the most recently used)
_DEEPEST = 4096  # how far into a band an agent looks for a task of its own
_OWNERS_KEPT = 2 * _DEEPEST  # tasks whose owner is remembered (for one set of peers)
_UNHELD_KEPT = 8192  # takes remembered of tasks we do not hold (see `QueueView._unheld`)
# Such a take is of a task created this long before we learnt of it, or of another task under
# the same name: a creationTimestamp is whole seconds, and our picture of the server's time
# may be off by a little.
_MADE_BEFORE_S = 2.0
# A task that came to us when the members changed, from a peer that is claiming, may be one
# it took untold: it is left to that peer until it writes its member Lease (it tells at once,
# `Membership.peers_changed`), or this long after the last change (it had nothing to tell).
_MOVED_S = 0.5
# An agent with none of its own takes from a claiming peer's backlog (`QueueView._tail`) while
# the operator projects claims (one seen this recently: what the peer took leaves our picture
# within a moment), and only from a peer with at least this many left in our view: the one it
# comes to last, long before it gets there.
_PROJECTED_S = 2.0
_PROJECTED = frozenset({models.Phase.RUNNING.value, *models.TERMINAL_PHASES})  # what a projected claim says
_TAIL_LEFT = 4
# Every agent of a queue reads every event of its Tasks: one that arrives after a quiet spell
# is read at once, the ones close behind it, each at most this late, together (`Kube.watch`).
# A claim made on older news may lose a race (each is checked against the task's Lease); a
# holder hears of its task's cancel or ended attempt that much later.
_TASK_BATCH_S = 0.1


def queue_selector(queue: str) -> str:
    """Every Task of `queue`: what the watch of its open Tasks selects once they are listed
    (`Reflector.watch_field_selector`): a task that finishes then arrives as the operator's
    status write, encoded once by the API server for every agent, not as a DELETED encoded
    for each of them."""
    return f"spec.queue={queue}"


def task_selector(queue: str) -> str:
    """Tasks of `queue` whose projected phase is not terminal (the server filters)."""
    return ",".join([queue_selector(queue), *(f"status.phase!={p}" for p in models.TERMINAL_PHASES)])


def unheld_selector(queue: str) -> str:
    """`task_selector`, without the tasks projected Running (held; one freed a moment ago is
    found by a later look): what a claim that keeps no index reads."""
    return f"{task_selector(queue)},status.phase!={models.Phase.RUNNING.value}"


def lease_selector(queue: str) -> str:
    """Free Leases only: a Lease that stops matching (claimed, closed, deleted) arrives as
    DELETED, with its previous content; for an agent all three mean "not claimable"."""
    return f"{record.LABEL_QUEUE}={queue},{record.LABEL_STATE}={record.FREE}"


@dataclass
class _Moved:
    """How the tasks were divided before the members changed (`QueueView._divide`), while
    what moved to us may still be a claiming peer's, taken untold."""

    peers: frozenset[str]
    viewers: tuple[frozenset[str], ...]
    until: datetime  # `_MOVED_S` after the last change
    heard: set[str]  # peers that wrote their member Lease since: they told what they took
    held: set[str]  # peers under whom we parked a task that came to us


@dataclass(frozen=True)
class Peer:
    """A member of the queue as this agent last saw it (`protocol.members`)."""

    holder: str
    holding: int
    claiming: bool  # taking its own tasks: they are left to it
    waiting: bool  # in a claim that waits for a task: it takes its shards' tasks as they come
    until: datetime  # gone, unless renewed before (our clock: when we saw it, plus its duration)


def _outside(peer: Peer) -> bool:
    """`peer` neither claims nor waits in a claim: no claim of its own takes its shards' tasks."""
    return not peer.claiming and not peer.waiting


def _peer_set(live: list[Peer], holder: str) -> frozenset[str]:
    """Among whom the tasks are divided: the live members, and `holder` (before its own
    member Lease is seen)."""
    return frozenset((*(m.holder for m in live), holder))


def _made_before(task: TaskView, learnt: datetime) -> bool:
    """Whether a take of task `task`'s name, learnt at `learnt`, is of this task: it was
    created `_MADE_BEFORE_S` before (else it may be another made since under the same name)."""
    created = parse_time(task.created)
    return created is not None and created <= learnt - timedelta(seconds=_MADE_BEFORE_S)


def _count_down(counter: Counter[K], key: K) -> None:
    """One less of `key`; none left, no key (a Counter's `max` and `get` see only the live ones)."""
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]


class QueueView:
    """A live, thread-safe picture of one queue's open tasks, their Leases and which are claimable."""

    def __init__(self, kube: Kube, *, namespace: str, queue: str, holder: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`holder`: the agent that claims through this view; it watches the tasks of the
        shards it views only (`TaskWatches`). Without one, every shard is watched.
        `clock`: seconds, for how long tasks have been candidates (tests inject one)."""
        self.queue = queue
        self._holder = holder
        self._clock = clock
        self._now = kube.now  # the API server's time: what a Task's and a Lease's times mean
        self._namespace = namespace
        # Every open task compact (`compact`: what `TaskView.of` reads, nothing else): under a
        # hundred bytes where a TaskView takes about two kilobytes. Views are decoded again on
        # demand and the recent ones kept: the window's candidates are looked at again and again.
        self._tasks: dict[str, bytes] = {}
        self._decoded: OrderedDict[str, TaskView] = OrderedDict()
        self._leases: dict[str, LeaseRecord] = {}  # the free ones, without their history: see _on_lease
        self._histories: dict[str, str] = {}  # name → the Lease's history annotation, as sent
        # Tasks taken (by us, by a peer, or a race we lost) → the resourceVersion of the free Lease
        # we knew then ("" for none): not claimable until their Lease is seen free in another version.
        self._taken: dict[str, str] = {}
        self._pruned = False  # `_taken` kept only what the first list holds
        # Takes of tasks we do not hold (of shards others view, or not listed yet), as `_taken`
        # would have them, and when we learnt of them: a shard that comes to us brings its
        # tasks listed open, and without the operator's projection a task taken untold by us
        # looks claimable. The oldest are forgotten (a race lost, no rule).
        self._unheld: OrderedDict[str, tuple[str, datetime]] = OrderedDict()
        self._tasks_started = False
        self._index = CandidateIndex()
        self._fresh: OrderedDict[str, float] = OrderedDict()  # see _RIPE_S: name → since when
        self._backoffs: list[tuple[datetime, str]] = []  # (not-before, name), stale entries allowed
        self._members: dict[str, Peer] = {}  # member Lease name → the agent at work; candidates are divided among them
        self._owners: dict[str, Ownership] = {}  # name → its owner among `_owners_of`
        self._ours: dict[str, float | None] = {}  # name → our weight if ours among `_owners_of`
        self._owners_of: frozenset[str] = frozenset()
        self._viewers: tuple[frozenset[str], ...] = viewers(frozenset())  # per shard, among `_owners_of`
        self._moved: _Moved | None = None  # until `_MOVED_S` after the members last changed
        # Others' candidates whose owner is claiming (name → the owner, "" while every peer is,
        # and the band): out of the index until it stops claiming or the peers change. Without
        # this, every look would pass again what its owner took and has not told. Counted by
        # owner and by band: strict priority holds lower bands back while one is parked.
        self._parked: dict[str, tuple[str, int]] = {}
        self._parked_owners: Counter[str] = Counter()
        self._parked_bands: Counter[int] = Counter()
        self._projected_at = -float("inf")  # `clock` when a claim's projection last reached us
        self._changed = threading.Condition()
        self._generation = 0  # moves only when something may have become claimable
        self.wakeups = 0  # how many events woke the waiting claimers (the bench reads it)
        self.task_listeners: list[Listener] = []  # also told of every Task event, after the view
        self.peer_listeners: list[Callable[[str], None]] = []  # told of each member that comes or goes
        self._tasks_watch = TaskWatches(kube, namespace=namespace, queue=queue, listener=self._on_task,
                                        drop=self._on_dropped, field_selector=task_selector(queue),
                                        watch_field_selector=queue_selector(queue), batch_s=_TASK_BATCH_S)
        self._reflectors = [
            Reflector(kube, LEASES, namespace=namespace, label_selector=lease_selector(queue),
                      listener=self._on_lease, keep_objects=False),
            Reflector(kube, LEASES, namespace=namespace, label_selector=members.selector(queue),
                      listener=self._on_member, keep_objects=False),
        ]

    def start(self, timeout_s: float = 30.0, *, tasks: bool = True, failing_s: float | None = None) -> None:
        """Wait until the watches of the queue's members and free Leases have their first list
        and, with `tasks`, the watch of its Tasks its first page: the rest of a deep queue is
        listed in the background (`listed`; until then a claim reads the best band itself,
        `unlisted`). Without `tasks`, `start_tasks` starts that watch later. `timeout_s` bounds
        a silence, not a long list: every page that arrives gives it `timeout_s` more.
        `failing_s`: a watch whose requests fail (the API server cannot be reached) is given
        up on after that long, if sooner (a claim's own timeout)."""
        failing = min(timeout_s, timeout_s if failing_s is None else failing_s)
        for r in self._reflectors:
            r.start()
        for r in self._reflectors:  # both listed at once
            self._await(r, first_page=False, timeout_s=timeout_s, failing_s=failing)
        if tasks:
            self.start_tasks()
            self._await(self.task_watch, first_page=True, timeout_s=timeout_s, failing_s=failing)

    def start_tasks(self) -> None:
        """Start listing the queue's open Tasks, if not started yet (see `start`). A Lease, and a
        peer's took, are judged again when their Task arrives."""
        with self._changed:
            if not self._tasks_started:
                now = self._now()
                peers = _peer_set(self._live_members(now), self._holder)
                self._divide(peers, now)  # `_divide` moves no watch yet
                others = peers - {self._holder}
                self._note_moved(others, viewers(others), now)  # we joined: what is ours was the others'
                self._tasks_started = True
                self.task_watch.start(self._viewed())

    def _await(self, r: Reflector | TaskWatches, *, first_page: bool, timeout_s: float, failing_s: float) -> None:
        began = time.monotonic()
        deadline = began + timeout_s
        pages = 0
        while not (r.synced.is_set() or (first_page and r.pages > 0)):
            r.synced.wait(0.1)
            if r.pages != pages:
                pages, deadline = r.pages, time.monotonic() + timeout_s
            # Refusals are final (RBAC, a missing CRD); a flaky network gets until the deadline.
            final = r.error is not None and not isinstance(r.error, (errors.Unreachable, errors.ServerError))
            failed = r.error is not None and not pages and time.monotonic() > began + failing_s
            if final or failed or time.monotonic() > deadline:
                self.stop()
                if isinstance(r.error, errors.TaskleaseError):
                    raise r.error
                raise errors.Unreachable(f"the watch of queue {self.queue!r} did not start: "
                                         f"{r.error or f'no answer in {timeout_s:.0f}s'}")

    @property
    def listed(self) -> bool:
        """The first list of the queue's open Tasks has ended: the index holds every candidate."""
        return self.task_watch.synced.is_set()

    def wait_listed(self, timeout_s: float) -> bool:
        return self.task_watch.synced.wait(timeout_s)

    def unlisted(self, tasks: list[TaskView], holder: str, now: datetime) -> tuple[list[Candidate], Division]:
        """Before `listed`: which of `tasks` (read from the API server by the caller, best
        first) may be claimed at `now`, by the Leases this view knows (every free one), divided
        among the members as `choose` divides. A task claimed since it was read costs a 409."""
        with self._changed:
            peers = _peer_set(self._live_members(now), holder)
            found = self._claimable(tasks, now)
            busy = {m.holder for m in self._members.values() if m.holding}
            division = divide(holder, list(found), functools.partial(owner, peers), busy)
            return [found[n] for n in division.names], division

    def claimable(self, tasks: list[TaskView], now: datetime) -> list[TaskView]:
        """Those of `tasks` that `unlisted` would offer someone, in their order, undivided."""
        with self._changed:
            return [task for task, _ in self._claimable(tasks, now).values()]

    def _claimable(self, tasks: list[TaskView], now: datetime) -> dict[str, Candidate]:
        """Caller holds the lock. Those of `tasks` that may be claimed at `now`, by the Leases
        this view knows, by name, in their order."""
        found: dict[str, Candidate] = {}
        for task in tasks:
            rec = self._leases.get(task.name)
            tried = self._taken.get(task.name)
            if tried is None:
                tried = self._unheld_take(task)  # read from the API server, not (yet) held
            if tried is not None and tried == (rec.resource_version if rec else ""):
                continue  # taken since, as far as we know
            if rec is None and task.status_attempt:
                continue  # claimed before and its Lease is not free: held or closed
            if blocker(task, rec, now) is None:
                found[task.name] = (task, self._with_history(task.name))
        return found

    def stop(self) -> None:
        self.task_watch.stop()
        for r in self._reflectors:
            r.stop()

    def wake(self) -> None:
        """Wake every claimer waiting on this view now (its agent is closing)."""
        with self._changed:
            self._bump()

    @property
    def task_watch(self) -> TaskWatches:
        """The watches of the queue's open Tasks that this agent views."""
        return self._tasks_watch

    def _divide(self, peers: frozenset[str], now: datetime) -> None:
        """Caller holds the lock. The members are now `peers`: the tasks are divided anew (what
        we parked may be ours now), and so are the shards."""
        if self._tasks_started:
            self._note_moved(self._owners_of, self._viewers, now)
        self._owners, self._ours, self._owners_of = {}, {}, peers
        self._viewers = viewers(peers)
        if self._tasks_started:
            self.task_watch.view(self._viewed())
        self._unpark(None, now)

    def _note_moved(self, peers: frozenset[str], shards: tuple[frozenset[str], ...], now: datetime) -> None:
        """Caller holds the lock. The tasks were divided among `peers`, the shards viewed by
        `shards`, and are divided anew at `now` (see `_MOVED_S`). Changes in a row are judged
        from the division before the first."""
        if self._holder and (self._moved is None or self._moved.until <= now):
            self._moved = _Moved(peers=peers, viewers=shards, until=now, heard=set(), held=set())
        if self._moved is not None:
            self._moved.until = now + timedelta(seconds=_MOVED_S)

    def _viewed(self) -> frozenset[int]:
        """Caller holds the lock. The shards whose tasks this agent watches."""
        return frozenset(s for s, v in enumerate(self._viewers) if not self._holder or self._holder in v)

    def _moved_from(self, name: str, claiming: Collection[str]) -> str:
        """Caller holds the lock. The claiming peer, not heard from since the members changed,
        whose task `name` (ours now) was before; "" if none."""
        moved = self._moved
        if moved is None or name in self._leases:  # a free Lease's claim reaches us at once
            return ""
        shard = self.task_watch.shard(name)
        was = owner(moved.peers if shard is None else moved.viewers[shard], name)[1]
        return was if was in claiming and was not in moved.heard and was != self._holder else ""

    def _peers_of(self, name: str) -> frozenset[str]:
        """Caller holds the lock. Among whom task `name` is divided: its shard's viewers, or
        every member for a task that every agent watches."""
        shard = self.task_watch.shard(name)
        return self._owners_of if shard is None else self._viewers[shard]

    def choose(self, holder: str, now: datetime, *, window: int,
               limit: int | None = None) -> tuple[list[Candidate], Division]:
        """What `holder` should try now, best first (at most `limit`), and how they divide:
        the oldest claimable tasks of the highest priority band, `holder`'s own first (see
        `divide`). Empty when nothing is claimable.

        How many of the oldest: `window`, or more with many agents at work, so that every
        agent at work owns some of them (`_SPREAD_PER_HOLDER` per peer or lease held in the
        queue); and when none of those is ours while the band goes on, deeper (up to
        `_DEEPEST`): an agent whose peers own the oldest tasks must not idle beside a deep queue."""
        with self._changed:
            if not self._pruned and self.listed:
                # Claims made before the list ended, of tasks it did not hold (done by then, or
                # of shards others view).
                for name in [n for n in self._taken if n not in self._tasks]:
                    self._keep_unheld(name, self._taken.pop(name), now)
                self._pruned = True
            self._release_due(now)
            if self._moved is not None and self._moved.until <= now:
                formers, self._moved = self._moved.held, None
                self._unpark(formers, now)
            live = self._live_members(now)
            peers = _peer_set(live, holder)
            if peers != self._owners_of:
                self._divide(peers, now)
            claiming = {m.holder: m.until for m in live if m.claiming and m.holder != holder}
            held = sum(m.holding for m in live if m.holder != holder)
            window = max(window, _SPREAD_PER_HOLDER * max(held, len(peers)))
            while True:
                names = self._index.best(window) if limit != 0 else []
                held_back = max(self._parked_bands, default=None)
                if not names or (held_back is not None and (self._index.priority(names[0]) or 0) < held_back):
                    # Nothing, or only what claiming peers take themselves, or a lower band than
                    # one of theirs (strict priority): look again when the first of them would be
                    # gone, were it silent (one that tells, stops claiming or leaves wakes us).
                    tail = self._tail(holder, now, claiming) if limit != 0 else None
                    if tail is not None:
                        return [(self._view(tail), self._with_history(tail))], Division(
                            names=[tail], ours=0, owner=Owner.CLAIMING, deputy=True)
                    ends = [*claiming.values(), *((self._moved.until,) if self._moved else ())]
                    wait = min(ends) - now if self._parked and claiming else timedelta(0)
                    return [], Division(names=[], ours=0, owner=None, wait_s=max(wait.total_seconds(), 0.0),
                                        held_back=bool(names))
                # Kept across looks (each starts shallow again, and a deep one needs the owners of
                # all it passes); bounded, as taken tasks leave their entries behind.
                if len(self._owners) + len(self._ours) > _OWNERS_KEPT:
                    self._owners, self._ours = {}, {}
                weights = [(self._weight_if_ours(n, holder), n) for n in names]
                # Others' tasks whose owner claims leave the index now: later looks pass only ours.
                others = self._park([n for top, n in weights if top is None], claiming)
                # Ours first, best first, and only as many judged as wanted: at 16 agents 15 of
                # 16 names in the window are someone else's, and a claim tries one.
                tops = {n: top for top, n in weights if top is not None}
                ours = sorted(((tops[n], n) for n in self._hold_moved(list(tops), claiming)), reverse=True)
                mine: list[str] = []
                for _, name in ours:
                    if len(mine) == limit:
                        break
                    mine += self._ready([name], now)
                if mine:
                    return ([(self._view(n), self._with_history(n)) for n in mine],
                            Division(names=mine, ours=len(mine), owner=None))
                if not others:
                    continue  # none ours, the rest parked: they left the index, the band's next ones come
                deeper = len(names) == window and window < _DEEPEST
                # Going deeper needs only one of these claimable; a thief's pick needs them all.
                ready = self._ready(others, now, first_only=deeper)
                if ready and deeper:
                    window *= 4  # none of these is ours, and the band has more
                elif ready:
                    ripe, ripe_in = self._ripe(ready)
                    if not ripe:
                        return [], Division(names=[], ours=0, owner=None, wait_s=ripe_in)
                    division = divide(holder, ripe, self._owner, {m.holder for m in live if m.holding})
                    return [(self._view(n), self._with_history(n)) for n in division.names[:limit]], division

    def still(self, names: list[str], now: datetime) -> list[Candidate]:
        """Those of `names` (an earlier look's) still candidates at `now`, as the view has them
        now: a task cancelled, deleted or taken since has left the index."""
        with self._changed:
            return [(self._view(n), self._with_history(n)) for n in names
                    if n in self._index and self._ready([n], now)]

    def _park(self, names: list[str], claiming: Collection[str]) -> list[str]:
        """Caller holds the lock. Those of `names` (others' candidates) whose owner is not
        `claiming`, or that have a free Lease; the others leave the index until their owner
        stops claiming (`_unpark`). A free Lease's claim reaches every agent at once (it leaves
        their watch): such a task is no thief's loss, and one freed by expiry is not left to
        an owner that may have died claiming."""
        if not claiming:
            return names
        # While every peer claims, no owner need be known (16 hashes a task at 16 agents).
        everyone = len(claiming) == len(self._owners_of) - 1
        kept = []
        for name in names:
            peer = "" if everyone else self._owner(name)[1]
            priority = self._index.priority(name)
            if priority is not None and name not in self._leases and (everyone or peer in claiming):
                self._park_under(name, peer, priority)
            else:
                kept.append(name)
        return kept

    def _hold_moved(self, names: list[str], claiming: Collection[str]) -> list[str]:
        """Caller holds the lock. Those of `names` (our candidates) that did not come to us
        from a claiming peer (`_moved_from`); the others leave the index, parked under it."""
        moved = self._moved
        if moved is None or not claiming:
            return names
        kept = []
        for name in names:
            was = self._moved_from(name, claiming)
            priority = self._index.priority(name)
            if was and priority is not None:
                moved.held.add(was)
                self._park_under(name, was, priority)
            else:
                kept.append(name)
        return kept

    def _park_under(self, name: str, peer: str, priority: int) -> None:
        """Caller holds the lock. Candidate `name`, of band `priority`, leaves the index until
        `peer` stops claiming (`_unpark`)."""
        self._parked[name] = (peer, priority)
        self._parked_owners[peer] += 1
        self._parked_bands[priority] += 1
        self._index.discard(name)

    def _tail(self, holder: str, now: datetime, claiming: Collection[str]) -> str | None:
        """Caller holds the lock, and no candidate of ours is left. Of the best band parked, the
        task that a claiming peer with the most left in our view (`_TAIL_LEFT` at least) comes
        to last: the one it weighs least (it takes its own by weight, heaviest first).
        Only tasks we are the deputy of (no other thief takes it), only while the operator
        projects claims (`_PROJECTED_S`: the peer's claims leave our picture within a moment,
        and so does this one, with no tell of ours), and none new (`_RIPE_S`). Of a deep
        backlog, the first `_DEEPEST` parked are enough: any of them is far from its owner's turn."""
        clock = self._clock()
        if not self._parked or clock - self._projected_at > _PROJECTED_S:
            return None
        band = max(self._parked_bands)
        self._forget_ripe(clock)
        left: Counter[str] = Counter()
        last: dict[str, tuple[float, str]] = {}  # peer → (its weight, name) at least
        for name, (_, priority) in itertools.islice(self._parked.items(), _DEEPEST):
            if priority != band or name in self._fresh or name in self._taken:
                continue
            top, peer, deputy = self._owner(name)
            if peer in claiming and deputy == holder:
                left[peer] += 1
                if peer not in last or (top, name) < last[peer]:
                    last[peer] = (top, name)
        most = max(left, key=lambda peer: (left[peer], peer), default=None)
        if most is None or left[most] < _TAIL_LEFT:
            return None
        return next(iter(self._ready([last[most][1]], now)), None)  # one not claimable leaves the parked

    def _unparked(self, name: str) -> bool:
        """Caller holds the lock. Forget that `name` is parked; False if it was not."""
        entry = self._parked.pop(name, None)
        if entry is None:
            return False
        _count_down(self._parked_owners, entry[0])
        _count_down(self._parked_bands, entry[1])
        return True

    def _unpark(self, owners: Collection[str] | None, now: datetime) -> None:
        """Caller holds the lock. The tasks parked for `owners` (None: all) are judged again."""
        if owners is not None and not any(self._parked_owners.get(o) for o in owners):
            return
        for name in [n for n, (peer, _) in self._parked.items() if owners is None or peer in owners]:
            self._judge(name, now)  # which unparks it

    def _ripe(self, names: list[str]) -> tuple[list[str], float]:
        """Caller holds the lock. Those of `names` (others' candidates) that may be taken from
        their owners now; and, if none, how soon the first may."""
        clock = self._clock()
        self._forget_ripe(clock)
        ripe = [n for n in names if n not in self._fresh]
        return ripe, 0.0 if ripe else min(self._fresh[n] for n in names) + _RIPE_S - clock

    def _note_fresh(self, name: str) -> None:
        """Caller holds the lock."""
        clock = self._clock()
        self._forget_ripe(clock)
        self._fresh[name] = clock
        self._fresh.move_to_end(name)

    def _forget_ripe(self, clock: float) -> None:
        """Caller holds the lock."""
        while self._fresh and next(iter(self._fresh.values())) <= clock - _RIPE_S:
            self._fresh.popitem(last=False)

    def _ready(self, names: list[str], now: datetime, *, first_only: bool = False) -> list[str]:
        """Caller holds the lock. Those of `names` claimable at `now` (with `first_only`, the
        first of them); the others met on the way are judged again (a deadline passed since
        they were indexed) and leave the index."""
        ready = []
        for name in names:
            task, rec = self._task(name), self._leases.get(name)
            if task is not None and blocker(task, rec, now) is None:
                ready.append(name)
                if first_only:
                    break
            else:
                self._judge(name, now)
        return ready

    @property
    def partial(self) -> bool:
        """The view leaves out the tasks of some shards (their viewers are others)."""
        return len(self.task_watch.viewed) < SHARDS

    def peers_outside_claims(self, holder: str) -> bool:
        """Whether a peer of `holder` neither claims nor waits in a claim (busy with the tasks it
        holds, or making no claim at all): the tasks it views that it would own are left to its
        deputy, or to an agent that reads them (`Agent._beyond`)."""
        with self._changed:
            return any(_outside(m) and m.holder != holder for m in self._live_members(self._now()))

    def claimable_count(self) -> int:
        with self._changed:
            return len(self._index)

    def next_not_before(self) -> datetime | None:
        """The earliest backoff or delayed start still running among open tasks: when to look
        again without an event."""
        with self._changed:
            while self._backoffs and not self._waiting(*self._backoffs[0]):
                heapq.heappop(self._backoffs)
            return self._backoffs[0][0] if self._backoffs else None

    def generation(self) -> int:
        with self._changed:
            return self._generation

    def wait_for_change(self, since: int, timeout_s: float) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self._generation != since, timeout=timeout_s)

    def wait_for_member(self, holder: str, timeout_s: float) -> bool:
        """Wait until `holder`'s member Lease is in our picture, or `timeout_s`."""
        with self._changed:
            return self._changed.wait_for(lambda: any(m.holder == holder for m in self._members.values()),
                                          timeout=timeout_s)

    def mark_taken(self, name: str, tried: LeaseRecord | None) -> None:
        """After a claim of `name` made on `tried` (its free Lease, or none), ours or a lost race:
        skip it until its Lease is seen free in another version."""
        with self._changed:
            self._taken[name] = tried.resource_version if tried else ""
            self._index.discard(name)
            self._unparked(name)  # a claiming peer's, taken from its backlog (`_tail`)
            current = self._leases.get(name)
            if (current.resource_version if current else "") != self._taken[name]:
                self._judge(name, self._now())  # it changed since the look we tried it from

    def _on_task(self, kind: str, obj: JSON) -> None:
        name = obj["metadata"]["name"]
        held = self._tasks.get(name) if kind == "ADDED" else None
        text = b"" if held is None else compact(obj, queue=self.queue)
        if text == held:
            # Listed again as it is held (a list made again after the API server cut one short):
            # no news, so nothing to validate or judge again, on every agent listing at once.
            self._notify(kind, obj)
            return
        view = None if kind == "DELETED" else TaskView.of(obj)
        text = b"" if view is None else text or compact(obj, queue=self.queue)
        with self._changed:
            if (obj.get("status") or {}).get("phase") in _PROJECTED:
                self._projected_at = self._clock()  # the operator projects claims (`_tail`)
            if view is None:
                self._forget(name, lease=True)  # finished (it left the phase selector) or deleted
            else:
                before = self._tasks.get(name)
                if before is None:
                    self._recall(view)
                elif not same_task(before, text):
                    # Deleted and made again under its name, told as one event (a watch that
                    # waited out a list keeps each name's last): what we knew of the old one goes.
                    self._forget(name, lease=False)
                self._tasks[name] = text
                self._remember(name, view)
                self._judge(name, self._now())
        self._notify(kind, obj)

    def _on_dropped(self, names: list[str]) -> None:
        """Tasks of shards we no longer view: our peers that view them claim them."""
        with self._changed:
            now = self._now()
            for name in names:
                if name in self._taken:
                    self._keep_unheld(name, self._taken[name], now)
                self._forget(name, lease=False)  # its free Lease stays known, should the shard come back

    def _keep_unheld(self, name: str, tried: str, now: datetime) -> None:
        """Caller holds the lock. Task `name`, which we do not hold, was taken (`tried` as in
        `_taken`), as we learnt at `now`."""
        self._unheld[name] = (tried, now)
        self._unheld.move_to_end(name)
        if len(self._unheld) > _UNHELD_KEPT:
            self._unheld.popitem(last=False)

    def _unheld_take(self, task: TaskView) -> str | None:
        """Caller holds the lock. What `_taken` would say of `task`, learnt while we did not
        hold it; None if nothing, or the task may have been made since (`_MADE_BEFORE_S`)."""
        entry = self._unheld.get(task.name)
        return entry[0] if entry is not None and _made_before(task, entry[1]) else None

    def _recall(self, view: TaskView) -> None:
        """Caller holds the lock. Task `view` arrived: a take we learnt of while we did not hold
        it holds."""
        tried = self._unheld_take(view)
        self._unheld.pop(view.name, None)
        if tried is not None:
            self._taken[view.name] = tried

    def _forget(self, name: str, *, lease: bool) -> None:
        """Caller holds the lock. Task `name` is out of the picture; with `lease`, its Lease too,
        as it no longer matters. Not a free Lease of another task, one made again under the
        name: the Lease watch is a stream of its own, and may bring the new task's free Lease
        before the Task watch tells the old one's end."""
        if lease:
            self._unheld.pop(name, None)
            rec = self._leases.get(name)  # the task is decoded only then: every finished task comes this way
            if rec is not None and (known := self._task(name)) is not None and known.uid == rec.owner_uid:
                del self._leases[name]
                self._histories.pop(name, None)
        self._tasks.pop(name, None)
        self._decoded.pop(name, None)
        self._taken.pop(name, None)
        self._judge(name, self._now())

    def _notify(self, kind: str, obj: JSON) -> None:
        for listener in self.task_listeners:
            listener(kind, obj)

    def _on_lease(self, kind: str, obj: JSON) -> None:
        meta = obj["metadata"]
        name = meta["name"]
        rec, history = None, ""
        if kind != "DELETED":
            # What is spent here is spent by every agent of the queue: the history is kept as
            # sent (decoded for candidates only, see `_with_history`), the result never read.
            rec = record.decode(obj, whole=False)
            history = (meta.get("annotations") or {}).get(record.ANN_HISTORY, "")
        with self._changed:
            now = self._now()
            if rec is None or rec.state != record.FREE:
                # It left the free selector: claimed, closed or deleted. Not claimable until seen free again.
                self._leases.pop(name, None)
                self._histories.pop(name, None)
                if name in self._tasks:
                    self._taken[name] = ""
                else:
                    self._keep_unheld(name, "", now)
            else:
                freed = name not in self._leases
                self._leases[name] = rec
                if history:
                    self._histories[name] = history
                else:
                    self._histories.pop(name, None)
                if freed and history:
                    self._forget_expired(history)
            self._judge(name, now)

    def _forget_expired(self, history: str) -> None:
        """Caller holds the lock. A Lease just freed by the operator's expiry of its last
        attempt: that holder stopped renewing, most likely dead. Counted until its member Lease
        lapses, it would keep its share of the queue, this task included, for that long; it is
        forgotten now, and its next member write, if it lives after all, brings it back (a
        false report costs races, never a rule: the claim checks the Lease)."""
        attempts = record.decode_history(history)
        if not attempts or attempts[-1].outcome != _EXPIRED:
            return
        gone = attempts[-1].holder
        for key in [k for k, m in self._members.items() if m.holder == gone]:
            del self._members[key]
            self._bump()  # the tasks are divided anew

    def _on_member(self, kind: str, obj: JSON) -> None:
        member = members.decode(obj)
        now = self._now()
        with self._changed:
            told = False
            for name in member.took if kind != "DELETED" else ():  # also when it leaves
                # Claimed by creating its Lease, which no watch of ours shows; a claim of a free
                # Lease was a DELETED already, and one freed since is in `_leases` again.
                if name in self._leases:
                    continue
                if name not in self._tasks:
                    self._keep_unheld(name, "", now)  # its shard may come to us, listed open
                    continue
                if not _made_before(self._view(name), now):
                    continue  # perhaps made again under its name since the claim told of
                self._taken[name] = ""
                self._index.discard(name)
                told = self._unparked(name) or told
            before = self._members.get(member.name)
            if kind == "DELETED" or not member.holder:
                self._members.pop(member.name, None)
            else:
                self._members[member.name] = Peer(holder=member.holder, holding=member.holding,
                                                  claiming=member.claiming, waiting=member.waiting,
                                                  until=now + timedelta(seconds=member.duration_s))
            after = self._members.get(member.name)
            came_or_went = (before and before.holder) != (after and after.holder)
            changed = (after.holder if after else before.holder if before else "") if came_or_went else ""
            if after is not None and self._moved is not None:
                self._moved.heard.add(after.holder)  # it told what it took: what came to us is ours
                if after.holder in self._moved.held:
                    self._unpark({after.holder}, now)
            if came_or_went and self._holder:  # our shards follow our peers, claiming or not
                peers = _peer_set(self._live_members(now), self._holder)
                if peers != self._owners_of:
                    self._divide(peers, now)
            outside = [m is not None and _outside(m) for m in (before, after)]
            if came_or_went or told or (outside[0] != outside[1] and self.partial):
                # A peer came or went (the tasks are divided anew), a band held back may be free,
                # or a peer left its claims (what its shards hold may be ours to read) or came back.
                self._bump()
            if after is None or not after.claiming:  # its share, if we parked any, is a thief's now
                self._unpark({before.holder if before else member.holder, ""}, now)
        if changed:
            for listener in self.peer_listeners:
                listener(changed)

    def _live_members(self, now: datetime) -> list[Peer]:
        """Caller holds the lock. The members not gone silent; the silent ones are forgotten."""
        for name in [n for n, m in self._members.items() if m.until <= now]:
            del self._members[name]
        return list(self._members.values())

    def _weight_if_ours(self, name: str, holder: str) -> float | None:
        """Caller holds the lock. `owned_weight` among the current peers, computed once per peer
        set (from the owner, when a thief's look found it already)."""
        known = self._owners.get(name)
        if known is not None:
            return known[0] if known[1] == holder else None
        if name not in self._ours:
            peers = self._peers_of(name)
            self._ours[name] = owned_weight(holder, peers, name) if holder in peers else None
        return self._ours[name]

    def _owner(self, name: str) -> Ownership:
        """Caller holds the lock. `owner` among the current peers, computed once per peer set."""
        found = self._owners.get(name)
        if found is None:
            found = self._owners[name] = owner(self._peers_of(name), name)
        return found

    def _task(self, name: str) -> TaskView | None:
        """Caller holds the lock."""
        view = self._decoded.get(name)
        if view is not None:
            self._decoded.move_to_end(name)
            return view
        text = self._tasks.get(name)
        if text is None:
            return None
        view = expand(text, name=name, namespace=self._namespace, queue=self.queue)
        self._remember(name, view)
        return view

    def _view(self, name: str) -> TaskView:
        """Caller holds the lock. The view of a task known to be open."""
        view = self._task(name)
        assert view is not None
        return view

    def _remember(self, name: str, view: TaskView) -> None:
        """Caller holds the lock."""
        self._decoded[name] = view
        self._decoded.move_to_end(name)
        if len(self._decoded) > _DECODED:
            self._decoded.popitem(last=False)

    def _with_history(self, name: str) -> LeaseRecord | None:
        """Caller holds the lock. The Lease of candidate `name`, whole again for the claim's write."""
        rec = self._leases.get(name)
        text = self._histories.get(name)
        if rec is None or not text:
            return rec
        return replace(rec, history=record.decode_history(text))

    def _judge(self, name: str, now: datetime) -> None:
        """Caller holds the lock. Re-decide one task; wake the claimers only if it became claimable.
        A parked task is unparked: a look parks it again if its owner still claims."""
        parked = self._unparked(name)
        task = self._task(name)
        rec = self._leases.get(name)
        if task is None:
            self._index.discard(name)
            return
        if name in self._taken:
            if self._taken[name] == (rec.resource_version if rec else ""):
                self._index.discard(name)
                return
            del self._taken[name]
        if rec is None and task.status_attempt:
            # Claimed before (its status says so) and its Lease is not free: held or closed.
            self._index.discard(name)
            return
        found = blocker(task, rec, now)
        if found is None:
            if self._index.add(name, task.spec.priority, task.created):
                # Not new: the first list's tasks, nor those we parked (known, and left to their owner).
                if rec is None and self.task_watch.synced.is_set() and not parked:
                    self._note_fresh(name)
                self._bump()
            return
        self._index.discard(name)
        until = task.spec.not_before if found is Blocker.SCHEDULED else \
            rec.not_before if found is Blocker.BACKING_OFF and rec is not None else None
        if until is not None:
            earliest = self._backoffs[0][0] if self._backoffs else None
            heapq.heappush(self._backoffs, (until, name))
            if earliest is None or until < earliest:
                self._bump()  # a waiting claimer must wake up sooner than it planned

    def _release_due(self, now: datetime) -> None:
        """Caller holds the lock. Tasks whose backoff ended are judged again."""
        while self._backoffs and self._backoffs[0][0] <= now:
            _, name = heapq.heappop(self._backoffs)
            self._judge(name, now)

    def _waiting(self, until: datetime, name: str) -> bool:
        """Caller holds the lock. Is `name` still backing off, or scheduled, until `until`?"""
        task, rec = self._task(name), self._leases.get(name)
        if task is None:
            return False
        return task.spec.not_before == until or (
            rec is not None and rec.not_before == until and rec.state == record.FREE)

    def _bump(self) -> None:
        self._generation += 1
        self.wakeups += 1
        self._changed.notify_all()

"""The agent SDK: claim a task, keep its lease alive, tell the work the moment it is lost.

    with Agent.connect() as agent:
        agent.start()                      # release what an older instance of this pod held
        with agent.claim(queue="emails") as task:
            send(task.payload, fence=task.epoch)
            task.complete("sent")

A claim goes one way: `Agent.claim` waits on the queue's picture (`discovery.QueueView`),
tries its best candidates with `Protocol.claim`, and hands the one it won to a `ClaimedTask`
(`claimed`), which renews it and ends it. A lost lease sets `task.lost` (see `claimed`).
`close()` (or leaving the Agent's `with` block) wakes every waiting claim, releases what the
agent holds and leaves its queues.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from datetime import datetime
from types import TracebackType
from typing import Any

from pydantic import BaseModel

from tasklease.agent.beside import Beside
from tasklease.agent.cancel import Followers
from tasklease.agent.claimed import ClaimedTask, Observer, Renewals, interrupt_allowed
from tasklease.agent.discovery import Candidate, QueueView, unheld_selector
from tasklease.agent.division import Division, Owner, weight
from tasklease.agent.gate import Gates, OneShotAdmission, queue_controls
from tasklease.agent.identity import Identity, container_of, instance_gone
from tasklease.agent.membership import Membership, Writes
from tasklease.agent.ranked import best_first
from tasklease.agent.settings import AgentSettings
from tasklease.agent.worker import Handler, Worker
from tasklease.api import errors, models
from tasklease.kube import JSON, LEASES, Kube
from tasklease.protocol import Held, Protocol, TaskView, members, record
from tasklease.protocol.labels import DEFAULT_PRIORITY
from tasklease.protocol.members import MemberLease

__all__ = ["Agent", "AgentSettings", "ClaimedTask", "Identity", "instance_gone"]

log = logging.getLogger(__name__)

# A one-shot claim's writes of one task: a create that finds a Lease, then a claim of it, then one
# more after a write that left it free (the operator correcting a backoff end). Bounded: a
# writer rewriting it without end only moves the claim to the next task.
_CLAIM_TRIES = 3


class Agent:
    """Claims tasks for one identity. Thread-safe; one QueueView (three watches) per queue, and a
    member Lease in each queue it claims from (`membership`)."""

    def __init__(self, kube: Kube, *, namespace: str | None = None, identity: Identity | None = None,
                 best_of: int | None = None, settings: AgentSettings | None = None,
                 metrics: Observer | None = None) -> None:
        """`best_of`: a shorthand for `settings.best_of`. `metrics`: counts every attempt
        (`agent.metrics.AgentMetrics`, opt-in)."""
        self.metrics = metrics
        self.kube = kube
        self.namespace = namespace or kube.namespace
        self.identity = identity or Identity.from_environment()
        self.protocol = Protocol(kube)
        self.settings = settings or AgentSettings()
        if best_of is not None:
            self.settings = dataclasses.replace(self.settings, best_of=best_of)
        self._followers = Followers(kube)
        self._renewals = Renewals()
        self._beside = Beside()  # requests made beside a claim's own (`claim_once`, a first look)
        self._closed = threading.Event()
        self._views: dict[str, QueueView] = {}
        self._unshare: list[Callable[[], None]] = []
        self._members: dict[str, Membership] = {}  # the queues we claim from: our peers there know us
        self._member_writes = Writes()  # of the memberships closed
        self._claims: weakref.WeakSet[ClaimedTask] = weakref.WeakSet()
        # Per queue: the rest of a look's own candidates, and the view's generation it was made
        # at. Until something becomes claimable (the generation moves) those still candidates
        # are still our best: only we take ours. One look serves several claims (`_kept`).
        # Generation None: every task a read made before the list ended found (`_early`), judged
        # again on each use, also after the read's own round was lost (the peers that joined since
        # may own what looked ours), until a round from it is lost or the list ends.
        self._next: dict[str, tuple[int | None, list[Candidate]]] = {}
        # The queues where a claim was won before their list ended: no more reads of the best
        # tasks there (`_early`). While many agents list a deep queue, each read is one more scan
        # of it beside their lists, and most of what it finds a peer has claimed already.
        self._early_won: set[str] = set()
        # Queue → when a read for a better band than a look found (`_beyond`) found none: the next
        # is made no sooner than `idle_read_s` after (a queue whose tasks all sit below the default
        # band would otherwise be read at every look).
        self._nothing_beyond: dict[str, float] = {}
        self._views_lock = threading.Lock()
        self._gates = Gates(kube, namespace=self.namespace, holder=self.identity.holder)  # TaskQueue controls

    @classmethod
    def connect(cls, *, kubeconfig: str | None = None, namespace: str | None = None, **kwargs: Any) -> Agent:
        return cls(Kube.connect(kubeconfig=kubeconfig, namespace=namespace), **kwargs)

    @property
    def best_of(self) -> int:
        return self.settings.best_of

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def start(self) -> list[str]:
        """The live check (I5): release at once every lease an older instance of this pod, or
        an earlier pod of its name, still holds, instead of letting it wait out its duration,
        and end its membership of its queues (its peers would leave its share to it). Returns
        the names of the leases released."""
        selector = f"{record.LABEL_HOLDER_POD}={record.label_value(self.identity.pod)}"
        released = []
        for obj in self.kube.list(LEASES, namespace=self.namespace, label_selector=selector).get("items", []):
            rec = record.decode(obj)
            if rec.state != record.HELD or rec.holder_pod != self.identity.pod:
                continue
            gone = self._predecessor(rec.holder)
            if not gone:
                continue
            try:
                self.protocol.release(self.protocol.held_from(rec), f"its agent restarted as {self.identity.holder}")
            except errors.LostLease:
                continue
            log.info("released %s/%s: held by %s, %s", rec.namespace, rec.name, rec.holder, gone)
            released.append(rec.name)
        for obj in self.kube.list(LEASES, namespace=self.namespace, label_selector=members.LABEL_AGENT_OF)["items"]:
            holder = members.decode(obj).holder
            if record.holder_pod(holder) == self.identity.pod and self._predecessor(holder):
                with contextlib.suppress(errors.Conflict, errors.NotFound):  # written or gone since: not ours to end
                    members.retire(self.kube, obj)
        return released

    def _predecessor(self, holder: str) -> str:
        """Why `holder`, of our pod's name, is surely gone ("" if it may not be): an earlier pod of
        our name (another uid), or an older instance in our pod whose process /proc says is gone."""
        if not holder or holder == self.identity.holder:
            return ""
        ours, theirs = record.short_uid(self.identity.pod_uid), record.holder_pod_uid(holder)
        if ours and theirs and ours != theirs:
            return "an earlier pod of this name"
        instance = record.holder_instance(holder)
        if container_of(instance) != container_of(self.identity.instance) or not instance_gone(instance):
            return ""  # another container's agent, or a sibling process in ours: not a dead predecessor
        return "an older instance of this pod"

    def claim(self, queue: str, *, timeout: float | None = None, interrupt: bool = False,
              stop: threading.Event | None = None) -> ClaimedTask:
        """Wait (watch-driven, no polling) until a task of `queue` is ours. NothingToClaim on
        timeout, when `stop` is set, or when the agent is closed meanwhile. The timeout does not
        end before the first list of the queue's Tasks has: until then no look can tell that a
        deep queue holds nothing for us, nor while a task may be due already by what this
        process cannot yet tell of the server's clock (`_unsure_wait`). A lost lease sets
        `task.lost`; with `interrupt` (main thread only) it also raises LostLease inside the
        task's `with` block (`claimed._MainThreadInterrupt` says how, and its limits)."""
        settings = self.settings
        self._check_claim(queue, interrupt)
        # The queue's Tasks are listed after the first look (`_early`): at a deep queue, agents
        # started together would otherwise all list at once before any claims.
        view = self._view(queue, tasks=False, failing_s=timeout)
        self._gates.open(queue)
        best: Iterator[JSON] | None = None
        with self._views_lock:
            joined = queue in self._members
        if joined or view.listed:
            member = self._join(view)
        else:
            # The first look's reads need no membership, only the judging of what they found
            # does: the agent joins meanwhile.
            joining = self._beside.submit(self._join, view)
            best = self._best(view)
            member = joining.result()
        give_up = None if timeout is None else time.monotonic() + timeout
        rounds_lost = 0
        waiting: Callable[[], None] | None = None  # ends our wait (`Membership.waiting`), once we wait
        try:
            while True:
                self._check_open()
                if stop is not None and stop.is_set():
                    raise errors.NothingToClaim("stopped")
                since = view.generation()
                listed = view.listed
                kept = self._kept(view, since, listed)
                candidates, recheck, ours = kept or (
                    self._pick(view, member, stop) if listed else self._early(view, best))
                best = None
                view.start_tasks()
                admission = self._gates.admit(queue, wanted=bool(candidates))
                if admission.wait_s:  # paused, at its claim rate, or no slot free under maxRunning
                    candidates, recheck = [], admission.wait_s
                claimed, lost, rest = self._try(view, member, candidates, ours=ours, interrupt=interrupt)
                self._gates.bind(queue, admission, claimed)
                if claimed is not None:
                    if not listed:
                        with self._views_lock:
                            self._early_won.add(queue)
                    if rest and ours and listed:  # an early read is kept whole (`_early`)
                        with self._views_lock:
                            self._next[queue] = (since, rest)
                    return claimed
                wait = recheck
                if lost:
                    if kept is not None and not listed:  # an early read lost again: too stale, read anew
                        with self._views_lock:
                            self._next.pop(queue, None)
                    rounds_lost += 1
                    if rounds_lost < settings.lost_rounds and (view.claimable_count() or not listed):
                        continue  # the lost ones left the index: the next look offers others
                    # Round after round lost: our picture is behind. Let the watch catch up (the
                    # winners' writes are on their way) instead of spinning on stale candidates.
                    rounds_lost, wait = 0, settings.catch_up_s
                next_ready = view.next_not_before()
                if give_up is not None and listed:
                    left = give_up - time.monotonic()
                    if next_ready is not None:  # a task that may be due already is worth its wait
                        left = max(left, self._unsure_wait(next_ready) or 0.0)
                    if left <= 0:
                        raise errors.NothingToClaim(f"nothing claimable in queue {queue!r}")
                    wait = min(wait, left)
                if next_ready is not None:
                    wait = min(wait, max((next_ready - self.kube.now()).total_seconds(), 0.05))
                if stop is not None:
                    wait = min(wait, settings.stop_check_s)  # a local wake-up to notice `stop`, no request
                if waiting is None:
                    waiting = member.waiting()
                if listed:
                    view.wait_for_change(since, wait)
                else:  # every page of the list moves the generation
                    view.wait_listed(min(wait, settings.early_s))
        finally:
            if waiting is not None:
                waiting()

    def claim_once(self, queue: str, *, interrupt: bool = False) -> ClaimedTask:
        """One look, no watch, for the stateless CLI: the queue's open Tasks are read best first,
        strict priority across the queue (`ranked`: a few short pages of its highest band), and
        the first one that can be claimed is; the rest of the queue is never read. A task
        projected Running is not read (a task freed a moment ago is found by the next claim); a
        never-claimed one is claimed by creating its Lease, any other after reading its Lease.

        A task due within what this process cannot yet tell of the server's clock (a new
        process has read few whole-second `Date`s) may be due already: one more look then."""
        self._check_claim(queue, interrupt)
        # The queue's controls, read while its tasks are.
        controls = self._beside.submit(queue_controls, self.kube, namespace=self.namespace, queue=queue)
        admit = OneShotAdmission(self.kube, controls, namespace=self.namespace, queue=queue,
                                 holder=self.identity.holder)
        found = self._claim_pass(queue, interrupt, admit)
        if isinstance(found, datetime) and (wait := self._unsure_wait(found)) is not None:
            time.sleep(wait)
            found = self._claim_pass(queue, interrupt, admit)
        if isinstance(found, ClaimedTask):
            return found
        admit.give_back()
        raise errors.NothingToClaim(f"nothing claimable in queue {queue!r}")

    def _unsure_wait(self, due: datetime) -> float | None:
        """Seconds until `due` when it lies within what this process cannot yet tell of the
        server's clock (a new process has read few whole-second `Date`s, and `Kube.now` is the
        earliest the time can be): it may have come already, and whoever wrote it read a later
        clock. None when it is surely further off."""
        low, high = self.kube.server_clock.offset()
        wait = (due - self.kube.now()).total_seconds()
        return max(wait, 0.0) if wait <= (high - low).total_seconds() else None

    def _claim_pass(self, queue: str, interrupt: bool, admit: OneShotAdmission) -> ClaimedTask | datetime | None:
        """`claim_once`'s look: the task claimed, else the soonest time a task not yet due
        becomes due (None: none is waiting for a time). `admit` before each claim write."""
        soonest: datetime | None = None
        for obj in best_first(self.kube, namespace=self.namespace, field_selector=unheld_selector(queue),
                              page=self.settings.cli_page, beside=self._beside, fresh=True):
            task = TaskView.of(obj)
            rec = None if task.status_attempt == 0 else self.protocol.read(task.namespace, task.name)
            for _ in range(_CLAIM_TRIES):
                admit()
                # The claim's rule reads the server's clock a moment later; read before any answer
                # had dated it, this process's clock would be later than that by up to a second.
                now = self.kube.now()
                try:
                    held = self.protocol.claim(task, rec, self.identity.holder)
                except errors.NotClaimable as exc:
                    log.info("passed over %s/%s: %s", task.namespace, task.name, exc)
                    due = max((t for t in (task.spec.not_before, rec.not_before if rec else None)
                               if t is not None), default=None)
                    if due is not None and due > now and (soonest is None or due < soonest):
                        soonest = due
                    break
                except errors.Refused as exc:
                    log.info("passed over %s/%s: the API server refused its claim: %s", task.namespace, task.name, exc)
                    break
                except errors.Conflict:
                    # It had a Lease after all, or the Lease moved: another agent won (read
                    # held, not claimable: the next task), or the operator wrote it (free still).
                    rec = self.protocol.read(task.namespace, task.name)
                    if rec is None:
                        log.info("passed over %s/%s: its Lease was deleted meanwhile", task.namespace, task.name)
                        break
                    continue
                return self._claimed(task, held, interrupt=interrupt, follow=False)
        return soonest

    def work(self, queue: str, handler: Handler, *, concurrency: int = 1, stop: threading.Event | None = None,
             max_tasks: int | None = None, idle_timeout: float | None = None,
             payload_type: type[BaseModel] | None = None, drain: bool = True, grace_s: float = 30.0) -> int:
        """The worker loop (`worker.Worker`): claim, run `handler(task)` (`handler(task, payload)`
        with a `payload_type`), complete with what it returns; `concurrency` tasks at a time.
        Returns how many tasks it completed; stops on `stop`, after `max_tasks` completed, after
        `idle_timeout` idle, when the agent is closed, or (on the main thread, with `drain`) on
        SIGTERM, giving the running tasks `grace_s` to finish."""
        def claim(name: str, timeout: float | None, stopped: threading.Event) -> ClaimedTask:
            return self.claim(name, timeout=timeout, stop=stopped)
        return Worker(claim, queue, handler, concurrency=concurrency, stop=stop, max_tasks=max_tasks,
                      idle_timeout=idle_timeout, payload_type=payload_type, drain=drain, grace_s=grace_s,
                      retry_s=self.settings.retry_s).run()

    def close(self) -> None:
        """Wake every waiting `claim` (it raises NothingToClaim), release the tasks this agent
        still holds, leave its queues (its member Leases are deleted) and stop its watches.
        Idempotent; the agent claims nothing afterwards."""
        self._closed.set()
        with self._views_lock:
            views = list(self._views.values())
        for view in views:
            view.wake()
        for claim in list(self._claims):
            if not claim.finished:
                # Its work may still run: it is told, as of a lost lease, and its outcome refused.
                claim.give_back(f"its agent {self.identity.holder} closed")
        with self._views_lock:
            memberships = list(self._members.values())
            self._members.clear()
        for member in memberships:
            member.close()
            with self._views_lock:
                self._member_writes += member.writes
        with self._views_lock:
            unshares, self._unshare = self._unshare, []
            views, self._views = list(self._views.values()), {}
        for unshare in unshares:
            unshare()
        for view in views:
            view.stop()
        self._gates.close()
        self._followers.close()
        self._renewals.close()
        self._beside.shutdown(wait=False)

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise errors.NothingToClaim(f"agent {self.identity.holder} is closed")

    def _check_claim(self, queue: str, interrupt: bool) -> None:
        """What refuses a claim is refused before one is won: a claim refused after it would
        be held by no one until it expired."""
        self._check_open()
        models.check_queue(queue)
        if interrupt:
            interrupt_allowed()

    def watch(self, queue: str) -> QueueView:
        """Start watching `queue` now (claim does it on first use); idempotent. Its gate's
        watch too: a first claim would otherwise wait for that list (the API server answers
        a list only once its cache is as new as etcd, which can take a second on a busy one)."""
        view = self._view(models.check_queue(queue), tasks=True)
        view.start_tasks()
        self._gates.open(queue)
        return view

    def _view(self, queue: str, *, tasks: bool, failing_s: float | None = None) -> QueueView:
        """`queue`'s view, started (its Tasks' watch too, with `tasks`) if it is new; one whose
        watches fail for `failing_s` is not (`QueueView.start`)."""
        with self._views_lock:
            view = self._views.get(queue)
            if view is None:
                self._check_open()
                view = QueueView(self.kube, namespace=self.namespace, queue=queue, holder=self.identity.holder)
                view.start(tasks=tasks, failing_s=failing_s)
                self._views[queue] = view
                # Our claims in this queue hear of a cancel from this watch, not one more each.
                self._unshare.append(self._followers.share(namespace=self.namespace, queue=queue,
                                                           tasks=view.task_watch, listeners=view.task_listeners))
            return view

    def join(self, queue: str) -> QueueView:
        """Watch `queue` and become one of its members now (`claim` does both on first use):
        from then on its peers leave this agent's share of the queue to it, and its first
        claim does not wait to be counted among them."""
        view = self.watch(queue)
        self._join(view)
        return view

    def member_writes(self) -> Writes:
        """How many times this agent wrote its member Leases: writes it makes besides its tasks'."""
        with self._views_lock:
            return sum((member.writes for member in self._members.values()), self._member_writes)

    def _join(self, view: QueueView) -> Membership:
        """Become a member of `view`'s queue, the first time we claim from it (a watch alone
        does not): from now on our peers leave our share of its tasks to us."""
        with self._views_lock:
            member = self._members.get(view.queue)
            joining = member is None
            if member is None:
                self._check_open()
                pod = (self.identity.pod, self.identity.pod_uid) if self.identity.pod_uid else None
                member = Membership(MemberLease(self.kube, namespace=self.namespace, queue=view.queue,
                                                holder=self.identity.holder, pod=pod),
                                    holder=self.identity.holder, holding=self._holding)
                view.task_listeners.append(member.seen)  # the operator's projections tell our claims for us
                view.peer_listeners.append(member.peers_changed)
                member.start()
                self._members[view.queue] = member
        if joining:
            # Agents that joined before us are in our picture once we are (one watch, in order):
            # claiming sooner, agents started together would each take the whole queue for theirs.
            view.wait_for_member(self.identity.holder, self.settings.join_s)
        return member

    def _holding(self) -> int:
        return sum(1 for claim in list(self._claims) if not claim.finished)

    def _kept(self, view: QueueView, generation: int, listed: bool) -> tuple[list[Candidate], float, bool] | None:
        """The rest of the last look's own candidates that may still be claimed: from the index,
        if nothing became claimable since; from a read made before the list ended (`_early`,
        generation None), while it has not ended and some of it is ours, judged again by what
        the view knows now (the peers that joined since, the tasks they took). One early read
        serves many claims, and a second round when its first is lost: each read costs the API
        server a scan of the queue, and takes seconds at a deep one while the agents list it."""
        with self._views_lock:
            kept = self._next.pop(view.queue, None)
        if kept is None or (kept[0] is None) == listed or (listed and kept[0] != generation):
            return None
        now = self.kube.now()
        if kept[0] is None:
            candidates, division = view.unlisted([task for task, _ in kept[1]], self.identity.holder, now)
            if not (candidates and division.ours):
                return None
            with self._views_lock:
                self._next[view.queue] = kept
            return candidates, self.settings.early_s, True
        candidates = view.still([task.name for task, _ in kept[1]], now)
        return (candidates, self.settings.recheck_s, True) if candidates else None

    def _pick(self, view: QueueView, member: Membership,
              stop: threading.Event | None) -> tuple[list[Candidate], float, bool]:
        """What to try now, how long to wait before looking again if none of it is won, and
        whether a win is told as ours are (not as a theft, `Membership.took`)."""
        candidates, division = self._look(view)
        if view.partial and not division.held_back and not division.wait_s and (
                not candidates or candidates[0][0].spec.priority < DEFAULT_PRIORITY):
            beyond = self._beyond(view, candidates)
            if beyond is not None:
                return beyond
        if candidates and division.owner in (Owner.BUSY, Owner.IDLE):
            # Nothing of ours. An idle owner, if alive, takes its task at once: give its claim
            # time to reach us. Then its deputy goes first; the other thieves only after the
            # deputy's claim could have reached them, by our weight, one after the other.
            pause = self.settings.spread_s * ((1 if division.owner is Owner.IDLE else 0) + (
                0 if division.deputy else 2 - weight(self.identity.holder, candidates[0][0].name)))
            if (stop or self._closed).wait(pause):
                raise errors.NothingToClaim("stopped")
            candidates, division = self._look(view)
        if division.held_back:
            member.held_back()  # our peers are likely held back by what we took untold
        if division.wait_s:
            # All that is left belongs to agents that are claiming (they take it themselves), or
            # is others' and new (their owners may have it already). Look again when that may
            # have changed; a peer that stops claiming or leaves, or a task freed, wakes us sooner.
            return [], max(division.wait_s, self.settings.spread_s), False
        # Ours (a race lost over one of ours means a peer knows other peers than we do: the
        # next look offers our others), or a thief's pick. One from the far end of a claiming
        # peer's backlog is told by the operator's projection, as ours are (`QueueView._tail`):
        # that peer reaches it last, and no other thief views it.
        return candidates, self.settings.recheck_s, bool(division.ours) or division.owner is Owner.CLAIMING

    def _beyond(self, view: QueueView, found: list[Candidate]) -> tuple[list[Candidate], float, bool] | None:
        """A look at the shards we view found nothing, or only tasks below the default band:
        the shards our peers view may hold better ones (strict priority), or tasks that their
        viewers leave, being outside their claims (a thief's). Read the queue's best (`_best`)
        and judge it as before the list ended (`QueueView.unlisted`), ours first. None: nothing
        to read for, or nothing better than `found`."""
        band = found[0][0].spec.priority if found else None
        if band is None and not view.peers_outside_claims(self.identity.holder):
            return None  # peers that claim, or wait in a claim, take their own shards' tasks
        with self._views_lock:
            if band is not None and time.monotonic() < self._nothing_beyond.get(view.queue, -math.inf):
                return None
        better = self._best_band(view, self._best(view), above=band)
        if better is not None:
            _, candidates, division = better
            return candidates, self.settings.early_s, bool(division.ours)
        if band is None:
            return [], self.settings.idle_read_s, False
        with self._views_lock:
            self._nothing_beyond[view.queue] = time.monotonic() + self.settings.idle_read_s
        return None

    def _best(self, view: QueueView) -> Iterator[JSON]:
        """The queue's open Tasks not projected Running, best first, as the API server's watch
        cache has them now (`ranked.best_first`), its first reads made before this returns;
        none when they fail (a loaded API server: the list goes on)."""
        found = best_first(self.kube, namespace=self.namespace, field_selector=unheld_selector(view.queue),
                           page=self.settings.early_reads, beside=self._beside, fresh=False)
        try:
            first = next(found, None)
        except (errors.Unreachable, errors.ServerError) as exc:
            log.info("could not read the best of queue %s before its list ended: %s", view.queue, exc)
            return iter(())
        return iter(()) if first is None else itertools.chain([first], found)

    def _early(self, view: QueueView, best: Iterator[JSON] | None) -> tuple[list[Candidate], float, bool]:
        """What to try while the queue's Tasks are still being listed (a deep queue takes a
        while): the best band's first tasks, read without reading the queue (`_best`, strict
        priority; `best`: read already), ours first. Of the first `early_reads` tasks read,
        those of the best band that may be claimed are kept whole: agents started together
        count different members at first, and one that loses a round to peers judges the same
        read again by the members it knows then (`_kept`), finding its own among them instead
        of reading again. A band read that far without one may have more below, which only
        the index will tell. Once a claim was won so (`_early_won`), what the last read kept is
        all: the next claim waits for the list."""
        with self._views_lock:
            if best is None and view.queue in self._early_won:
                return [], self.settings.early_s, False
        best_band = self._best_band(view, best if best is not None else self._best(view))
        tasks, candidates, division = best_band or ([], [], None)
        with self._views_lock:
            self._next[view.queue] = (None, [(task, None) for task in tasks])
        return candidates, self.settings.early_s, bool(division and division.ours)

    def _best_band(self, view: QueueView, read: Iterator[JSON], *, above: int | None = None
                   ) -> tuple[list[TaskView], list[Candidate], Division] | None:
        """Of the queue's best tasks `read` (`_best`; the first `early_reads`), the best band,
        above band `above` if given, with tasks we may claim, judged as before the list ended
        (`QueueView.unlisted`): those tasks in the order read, and them judged together (ours
        first). None: no such band, or the reads failed (a loaded API server: the list goes on)."""
        now = self.kube.now()
        try:
            for priority, band in itertools.groupby(map(TaskView.of, itertools.islice(read, self.settings.early_reads)),
                                                    key=lambda task: task.spec.priority):
                if above is not None and priority <= above:
                    return None
                tasks = view.claimable(list(band), now)
                candidates, division = view.unlisted(tasks, self.identity.holder, now)
                if candidates:
                    return tasks, candidates, division
        except (errors.Unreachable, errors.ServerError) as exc:
            log.info("could not read the best of queue %s before its list ended: %s", view.queue, exc)
        return None

    def _look(self, view: QueueView) -> tuple[list[Candidate], Division]:
        return view.choose(self.identity.holder, self.kube.now(), window=self.settings.best_of,
                           limit=self.settings.kept_per_look)

    def _try(self, view: QueueView, member: Membership, candidates: list[Candidate], *, ours: bool,
             interrupt: bool) -> tuple[ClaimedTask | None, list[str], list[Candidate]]:
        """Claim the first candidate we can, in order; also returns the names whose race we
        lost, and the candidates not tried."""
        lost = []
        for i, (task, rec) in enumerate(candidates[:self.settings.tries_per_look]):
            try:
                held = self.protocol.claim(task, rec, self.identity.holder)
            except (errors.Conflict, errors.NotClaimable, errors.Refused):  # Refused: its Lease breaks a rule
                lost.append(task.name)  # another agent won; the next candidate is another task
                view.mark_taken(task.name, rec)
                continue
            # Ours now: no watch of ours will show it (it is not free). Our peers: see `Membership.took`.
            view.mark_taken(task.name, rec)
            member.took(task.name, created=rec is None, stolen=not ours, priority=task.spec.priority)
            claimed = self._claimed(task, held, interrupt=interrupt)
            return claimed, lost, candidates[i + 1:]
        return None, lost, []

    def _claimed(self, task: TaskView, held: Held, *, interrupt: bool, follow: bool = True) -> ClaimedTask:
        """Take up a claim just won. Nothing between the win and the agent's record of it can
        fail without giving the task back, and an agent closed meanwhile gives it back."""
        log.info("claimed %s/%s (attempt %d) as %s", task.namespace, task.name, held.epoch, held.holder)
        try:
            claimed = ClaimedTask(self.protocol, held, task.spec.payload, interrupt=interrupt,
                                  followers=self._followers if follow else None, renewals=self._renewals,
                                  settings=self.settings, observer=self.metrics)
            self._claims.add(claimed)
        except BaseException:
            with contextlib.suppress(errors.TaskleaseError):
                self.protocol.release(held, "its agent could not take up the claim")
            raise
        if self._closed.is_set() and follow:
            with contextlib.suppress(errors.TaskleaseError):
                claimed.release(f"its agent {self.identity.holder} closed")
            raise errors.NothingToClaim(f"agent {self.identity.holder} is closed")
        return claimed

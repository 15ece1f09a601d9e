"""The agent's tuning, in one place: how often it renews, how long it waits, how far it looks.

The defaults suit every queue the project benchmarks (`make bench`); change one only for a
measured reason. `Agent(kube, settings=AgentSettings(best_of=64))`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AgentSettings:
    renews_per_duration: int = 3  # renewals per lease duration
    # No renewal succeeded for this part of the duration: the task is lost, before anyone else may take over.
    renew_deadline_fraction: float = 2 / 3
    retry_s: float = 1.0  # after a failed request
    finish_tries: int = 3  # an ending whose answer is lost is tried again, and recognised as ours
    catch_up_s: float = 0.5  # after rounds of lost races: the watch catches up with the winners' writes
    # How long a thief holds back (by its weight, once more for an idle owner); the least a claim waits.
    spread_s: float = 0.1
    lost_rounds: int = 3  # looks in a row that lost every race before waiting for the watch
    tries_per_look: int = 4  # a picture so stale that this many races are lost is not worth more requests
    # A look's own candidates, the rest kept for the claims after it while nothing changes: a look,
    # the costliest step of a claim outside its request, serves several claims.
    kept_per_look: int = 8
    best_of: int = 32  # how many of a band's oldest tasks a look divides among the queue's members
    stop_check_s: float = 0.5  # how often a waiting claim looks at its `stop` event
    join_s: float = 2.0  # the longest a first claim waits to see its own member Lease
    recheck_s: float = 60.0  # after a look whose candidates were all lost: the watch tells sooner if anything changes
    # While a peer is busy and this agent's shards hold nothing for it: how often it reads the
    # queue for the tasks of the busy peer's shards (no watch of ours tells of them); and after a
    # read for a better band than its shards offer found none, how long before the next.
    idle_read_s: float = 2.0
    cli_page: int = 20  # Tasks per page read by the one-shot claim (`tasklease claim`)
    # Before the first list of a queue's Tasks ends: the most of its best tasks a claim reads
    # (`ranked`, in one page: each read costs the API server a scan of the queue, and what it
    # finds of ours serves the claims after it; none after a claim is won so), and how long it
    # waits when none may be claimed.
    early_reads: int = 128
    early_s: float = 1.0

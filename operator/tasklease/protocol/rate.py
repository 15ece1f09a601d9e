"""A queue's claim rate (`spec.claimsPerSecond`): one shared token bucket in a Lease.

The bucket is a Lease `tasklease-slot.<queue>.rate` (a slot Lease by its label, so the
admission policy's slot rules bound it; it has no holder) whose annotation
`tasklease.dev/next-claim-at` is the generic cell rate algorithm's theoretical arrival time:
a claim may go when that time is at most `BURST_S` (or one interval, if longer) ahead of now, and moves it on by one
interval (1 / rate). Agents judge by the API server's clock (`Kube.server_clock`: they wait
by its earliest estimate and move the time on from its latest), and each write is
conditional on the version read, so two agents cannot both take the last token. A time
further ahead than any claim could have put it was written by someone else: it counts as now.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Final

from tasklease.api import errors
from tasklease.api.timestamps import format_time, parse_time
from tasklease.kube import LEASES, Kube
from tasklease.protocol.record import label_value
from tasklease.protocol.slots import DURATION_S, LABEL_SLOT_OF, PREFIX

log = logging.getLogger(__name__)

ANN_NEXT: Final = "tasklease.dev/next-claim-at"
BURST_S: Final = 1.0  # one second's claims may go at once


def lease_name(queue: str) -> str:
    return f"{PREFIX}{queue}.rate"


def wait_for_token(tat: datetime | None, now: datetime, rate: float,
                   latest: datetime | None = None) -> tuple[float, datetime]:
    """(seconds to wait before a claim may go, 0 when it may now; the new arrival time if it goes).
    `now` is the earliest the server's time can be, `latest` (default `now`) the latest: each
    agent's estimate is uncertain, so it waits by the one and moves the time on from the other."""
    latest = latest or now
    interval = timedelta(seconds=1 / rate)
    burst = max(timedelta(seconds=BURST_S), interval)  # at least one claim, however slow the rate
    if tat is None or tat - latest > burst + interval:
        tat = latest  # none yet, or not one a claim wrote
    start = max(tat, latest)
    wait = (start + interval - now - burst).total_seconds()
    return max(wait, 0.0), start + interval


def arrival(value: object) -> datetime | None:
    """The bucket's arrival time as written; None, which counts as now, for one that is no time
    with a zone (the admission policy refuses it, but a bucket written before the policy was
    may hold one): any agent may write the bucket, and no write of it stops a claim."""
    try:
        tat = parse_time(value)
    except (TypeError, ValueError):
        return None
    return tat if tat is None or tat.tzinfo is not None else None


def take(kube: Kube, *, namespace: str, queue: str, rate: float) -> float:
    """Take a token for one claim: 0 when taken, else the seconds to wait before asking again."""
    name = lease_name(queue)
    for _ in range(3):  # a conflict means another agent took one: look again
        obj = kube.get_or_none(LEASES, name, namespace=namespace, timeout=5)
        ann = ((obj or {}).get("metadata") or {}).get("annotations") or {}
        wait, tat = wait_for_token(arrival(ann.get(ANN_NEXT)), kube.now(), rate, kube.server_clock.latest())
        if wait > 0:
            return wait
        try:
            if obj is None:
                kube.create(LEASES, {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                                     "metadata": {"name": name, "labels": {LABEL_SLOT_OF: label_value(queue)},
                                                  "annotations": {ANN_NEXT: _text(tat)}},
                                     "spec": {"leaseDurationSeconds": DURATION_S}}, namespace=namespace, timeout=5)
            else:
                kube.merge_patch(LEASES, name, {"metadata": {"resourceVersion": obj["metadata"]["resourceVersion"],
                                                             "annotations": {ANN_NEXT: _text(tat)}}},
                                 namespace=namespace, timeout=5)
            return 0.0
        except (errors.Conflict, errors.NotFound):
            continue
        except errors.Invalid as exc:
            # A bucket this agent may not write (held, written by hand past the policy): no
            # write of it stops a claim. The operator still takes back claims beyond the rate.
            log.warning("the claim-rate bucket %s/%s cannot be written (%s): claiming without a token",
                        namespace, name, exc)
            return 0.0
    return 1 / rate


def _text(t: datetime) -> str:
    return format_time(t) or ""

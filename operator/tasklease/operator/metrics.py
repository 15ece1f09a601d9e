"""The operator's Prometheus metrics, in one registry served on /metrics.

Every per-queue series carries `namespace` and `queue`; a `phase` label holds only phase
values (Pending, Running, Succeeded, Failed, Cancelled), never a reason: dead letters have
their own counter. No `_created` series. A queue's series exist at zero from the moment
the operator first sees a task of it (`known_queue`), so rates and alerts work from the start.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterable
from importlib import metadata
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from tasklease.api.build import version
from tasklease.api.models import ATTEMPT_TIMED_OUT, Phase

disable_created_metrics()  # type: ignore[no-untyped-call]

REGISTRY = CollectorRegistry()
QUEUE: Final = ("namespace", "queue")
_DURATIONS: Final = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 4 * 3600, 24 * 3600)

TASKS = Gauge("tasklease_tasks", "Tasks by phase, as last projected.", [*QUEUE, "phase"], registry=REGISTRY)
CLAIMS = Counter("tasklease_claims_total", "Claims (new attempts) observed.", QUEUE, registry=REGISTRY)
COMPLETIONS = Counter("tasklease_completions_total", "Tasks that reached a terminal phase.", [*QUEUE, "phase"],
                      registry=REGISTRY)
EXPIRATIONS = Counter("tasklease_expirations_total",
                      "Leases expired by the operator, by cause (timeout, pod-gone, container-restarted).",
                      [*QUEUE, "cause"], registry=REGISTRY)
POD_BOUND_RENEWALS = Counter("tasklease_pod_bound_renewals_total",
                             "Pod-bound leases renewed by the operator while their holder's Pod runs.", QUEUE,
                             registry=REGISTRY)
REQUEUES = Counter("tasklease_requeues_total", "Attempts that ended with the task back in its queue.", QUEUE,
                   registry=REGISTRY)
DEAD_LETTERS = Counter("tasklease_dead_letters_total", "Tasks dead-lettered after maxAttempts.", QUEUE,
                       registry=REGISTRY)
RETRIES = Counter("tasklease_retries_total", "Finished tasks given a fresh budget by `tasklease retry`.", QUEUE,
                  registry=REGISTRY)
ATTEMPT_TIMEOUTS = Counter("tasklease_attempt_timeouts_total",
                           "Attempts the operator ended for running past their attempt timeout.", QUEUE,
                           registry=REGISTRY)
CLEANUPS = Counter("tasklease_cleanups_total", "Finished tasks deleted after their ttlSecondsAfterFinished.", QUEUE,
                   registry=REGISTRY)
QUEUE_WAIT = Histogram("tasklease_queue_wait_seconds",
                       "From creation (or the end of the previous attempt) to the claim.", QUEUE,
                       buckets=_DURATIONS, registry=REGISTRY)
RUN_TIME = Histogram("tasklease_run_seconds", "From the claim to the end of the attempt, by outcome.",
                     [*QUEUE, "outcome"], buckets=_DURATIONS, registry=REGISTRY)
TIME_TO_REQUEUE = Histogram(
    "tasklease_time_to_requeue_seconds",
    "From the last change of an abandoned lease (as observed) to its expiry write.", ["cause"],
    buckets=(0.1, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600), registry=REGISTRY)
STATUS_WRITES = Counter("tasklease_status_writes_total", "Task status writes, by result (ok, conflict, error).",
                        ["result"], registry=REGISTRY)
for _result in ("ok", "conflict", "error"):
    STATUS_WRITES.labels(_result)  # at zero from the start: the projection-failing alert divides by them
EVENTS_POSTED = Counter("tasklease_events_posted_total", "Events posted on Tasks.", registry=REGISTRY)
MALFORMED = Counter("tasklease_malformed_objects_total",
                    "Object versions read with fields that could not be used (ignored or cut), by kind and reason.",
                    ["kind", "reason"], registry=REGISTRY)
LEADER = Gauge("tasklease_operator_leader", "1 while this replica is the active one.", registry=REGISTRY)
PENDING_WORK = Gauge("tasklease_operator_queue_depth", "Tasks waiting to be reconciled.", registry=REGISTRY)

_PER_QUEUE: Final = (CLAIMS, REQUEUES, DEAD_LETTERS, RETRIES, CLEANUPS, QUEUE_WAIT, ATTEMPT_TIMEOUTS,
                     POD_BOUND_RENEWALS)
ATTEMPT_OUTCOMES: Final = ("Succeeded", "Failed", "Expired", ATTEMPT_TIMED_OUT, "Released", "Requeued", "Cancelled")


def known_queue(namespace: str, queue: str) -> None:
    """Create every series of a queue at zero (idempotent: cheap after the first call)."""
    for metric in _PER_QUEUE:
        metric.labels(namespace, queue)
    for phase in Phase:
        TASKS.labels(namespace, queue, phase.value)
        if phase.terminal:
            COMPLETIONS.labels(namespace, queue, phase.value)
    for cause in ("timeout", "pod-gone", "container-restarted"):
        EXPIRATIONS.labels(namespace, queue, cause)
    for outcome in ATTEMPT_OUTCOMES:
        RUN_TIME.labels(namespace, queue, outcome)


OldestPending = Callable[[], Iterable[tuple[str, str, float]]]


class _OldestPendingCollector(Collector):
    """`tasklease_oldest_pending_seconds`, computed at scrape time from the operator's picture."""

    def __init__(self) -> None:
        self.source: OldestPending = lambda: ()

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily("tasklease_oldest_pending_seconds",
                                   "Age of the oldest Pending task per queue (0 when none is pending).",
                                   labels=list(QUEUE))
        for namespace, queue, age in self.source():
            family.add_metric([namespace, queue], age)
        yield family


OLDEST_PENDING = _OldestPendingCollector()
REGISTRY.register(OLDEST_PENDING)


Claimable = Callable[[], Iterable[tuple[str, str, int, float]]]


class _ClaimableCollector(Collector):
    """`tasklease_claimable_tasks` and `tasklease_oldest_claimable_seconds`, computed at scrape
    time (`operator.claimable`): a backoff or a delayed start ends with no event."""

    def __init__(self) -> None:
        self.source: Claimable = lambda: ()

    def collect(self) -> Iterable[GaugeMetricFamily]:
        count = GaugeMetricFamily("tasklease_claimable_tasks",
                                  "Pending tasks an agent could claim now (backoff and notBefore passed, "
                                  "by the operator's clock).", labels=list(QUEUE))
        oldest = GaugeMetricFamily("tasklease_oldest_claimable_seconds",
                                   "How long the longest-waiting claimable task of a queue has been claimable "
                                   "(0 when none is).", labels=list(QUEUE))
        for namespace, queue, n, age in self.source():
            count.add_metric([namespace, queue], n)
            oldest.add_metric([namespace, queue], age)
        yield count
        yield oldest


CLAIMABLE = _ClaimableCollector()
REGISTRY.register(CLAIMABLE)


def _build_info() -> Gauge:
    labels = {"version": version(), "python": platform.python_version(),
              "kopf": metadata.version("kopf"), "kubernetes_client": metadata.version("kubernetes")}
    info = Gauge("tasklease_build_info", "Always 1; the labels say which build runs.", list(labels),
                 registry=REGISTRY)
    info.labels(**labels).set(1)
    return info


BUILD_INFO = _build_info()

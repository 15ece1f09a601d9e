"""The operator's Prometheus metrics, in one registry served on /metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry()

TASKS = Gauge("tasklease_tasks", "Tasks by queue and phase, as last projected.", ["queue", "phase"],
              registry=REGISTRY)
CLAIMS = Counter("tasklease_claims_total", "Claims (new attempts) observed.", ["queue"], registry=REGISTRY)
EXPIRATIONS = Counter("tasklease_expirations_total", "Leases expired by the operator.", ["queue", "cause"],
                      registry=REGISTRY)
REQUEUES = Counter("tasklease_requeues_total", "Attempts that ended with the task back in its queue.", ["queue"],
                   registry=REGISTRY)
DEAD_LETTERS = Counter("tasklease_dead_letters_total", "Tasks dead-lettered after maxAttempts.", ["queue"],
                       registry=REGISTRY)
COMPLETIONS = Counter("tasklease_completions_total", "Tasks that reached a terminal phase.", ["queue", "phase"],
                      registry=REGISTRY)
TIME_TO_REQUEUE = Histogram(
    "tasklease_time_to_requeue_seconds",
    "From the last change of an abandoned lease (as observed) to its expiry write.", ["cause"],
    buckets=(0.1, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600), registry=REGISTRY)
STATUS_WRITES = Counter("tasklease_status_writes_total", "Task status writes, by result.", ["result"],
                        registry=REGISTRY)
EVENTS_POSTED = Counter("tasklease_events_posted_total", "Events posted on Tasks.", registry=REGISTRY)
LEADER = Gauge("tasklease_operator_leader", "1 while this replica is the active one.", registry=REGISTRY)
PENDING_WORK = Gauge("tasklease_operator_queue_depth", "Tasks waiting to be reconciled.", registry=REGISTRY)

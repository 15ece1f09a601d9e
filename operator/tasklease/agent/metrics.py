"""Opt-in Prometheus metrics of one agent: claims, completions, failures, releases, lost
leases and how long each attempt's work ran (docs/monitoring.md).

    metrics = AgentMetrics()               # needs prometheus-client: pip install 'tasklease[metrics]'
    metrics.serve(9100)                    # /metrics on 0.0.0.0:9100 (or expose `metrics.registry` yourself)
    agent = Agent(kube, metrics=metrics)

`tasklease run --metrics-port 9100` does the same. Each `AgentMetrics` has a registry of its
own, never the process-wide default one: two agents in one process keep their counts apart.
prometheus-client is imported only here, and only when metrics are asked for: the SDK and
the CLI run without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from tasklease.api import errors

if TYPE_CHECKING:
    from prometheus_client import Counter

    from tasklease.agent.claimed import ClaimedTask

# The end of an attempt as its holder saw it: `ClaimedTask.complete`, `fail`, `release`, or a lost lease.
OUTCOMES: Final = ("completed", "failed", "released", "lost")
_LABELS: Final = ("namespace", "queue")
_SECONDS: Final = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 4 * 3600)


class AgentMetrics:
    """The counters and the handler-duration histogram of one agent, in a registry of their own."""

    def __init__(self) -> None:
        try:  # an optional dependency: imported only when metrics are asked for
            from prometheus_client import CollectorRegistry, Counter, Histogram
        except ImportError:
            raise errors.Invalid("agent metrics need prometheus-client: pip install 'tasklease[metrics]'") from None
        self.registry = CollectorRegistry(auto_describe=True)

        def counter(name: str, help: str) -> Counter:
            return Counter(name, help, list(_LABELS), registry=self.registry)
        self.claims = counter("tasklease_agent_claims_total", "Tasks this agent claimed.")
        self.completions = counter("tasklease_agent_completions_total", "Attempts this agent completed.")
        self.failures = counter("tasklease_agent_failures_total", "Attempts this agent failed (retryable or final).")
        self.releases = counter("tasklease_agent_releases_total", "Attempts this agent gave back.")
        self.lost = counter("tasklease_agent_lost_leases_total",
                            "Attempts whose lease this agent lost (expired, cancelled, taken over).")
        self.handler_seconds = Histogram(
            "tasklease_agent_handler_seconds", "From the claim to the end of the attempt, by outcome.",
            [*_LABELS, "outcome"], buckets=_SECONDS, registry=self.registry)

    def serve(self, port: int, host: str = "") -> int:
        """Serve /metrics on `host:port` (all addresses when empty) from a thread; the port bound."""
        from prometheus_client import start_http_server

        server, _ = start_http_server(port, addr=host or "0.0.0.0", registry=self.registry)
        return int(server.server_address[1])

    def text(self) -> str:
        """The metrics in Prometheus' text format."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()

    # -- what `ClaimedTask` reports (its observer) ----------------------------------------------

    def claimed(self, task: ClaimedTask) -> None:
        self.claims.labels(task.namespace, task.held.spec.queue).inc()

    def ended(self, task: ClaimedTask, outcome: str, seconds: float) -> None:
        where = (task.namespace, task.held.spec.queue)
        counter = dict(zip(OUTCOMES, (self.completions, self.failures, self.releases, self.lost), strict=True))[outcome]
        counter.labels(*where).inc()
        self.handler_seconds.labels(*where, outcome).observe(seconds)

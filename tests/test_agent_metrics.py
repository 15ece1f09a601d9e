"""Agent-side metrics (opt-in): what an agent counts of its own attempts, on an injected clock
and a stand-in Protocol; then `tasklease run --metrics-port` against a real API server."""

from __future__ import annotations

import builtins
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from conftest import Cluster, make_task, tasklease_cmd, wait_for
from tasklease.agent.claimed import ClaimedTask
from tasklease.agent.metrics import AgentMetrics
from tasklease.api import errors, models
from tasklease.protocol import Held, LeaseRecord
from tasklease_dev.cluster import free_port
from fake_clock import Clock


class Writes:
    """Answers every ending at once; a complete after `lose_on_complete` is a lost lease."""

    def __init__(self, *, lose_on_complete: bool = False) -> None:
        self.lose_on_complete = lose_on_complete

    def renew(self, held: Held, *, timeout: float = 30) -> Held:
        return held

    def complete(self, held: Held, result: str) -> Held:
        if self.lose_on_complete:
            raise errors.LostLease("taken over")
        return held

    def fail(self, held: Held, message: str, *, retryable: bool = True) -> Held:
        return held

    def release(self, held: Held, message: str = "") -> Held:
        return held


def _claim(metrics: AgentMetrics, clock: Clock, writes: Any = None) -> ClaimedTask:
    spec = models.TaskSpec(queue="mail", lease_duration_seconds=3600)
    rec = LeaseRecord(name="t", namespace="ns", queue="mail", owner_uid="u", holder="p/1", epoch=1, duration_s=3600)
    held = Held(namespace="ns", name="t", holder="p/1", epoch=1, spec=spec, uid="u", record=rec)
    return ClaimedTask(writes or Writes(), held, {}, monotonic=clock, observer=metrics)


def _value(metrics: AgentMetrics, name: str, **labels: str) -> float:
    """The sample `name` with exactly `labels`, from the text Prometheus would scrape."""
    from prometheus_client.parser import text_string_to_metric_families

    found = [s.value for family in text_string_to_metric_families(metrics.text()) for s in family.samples
             if s.name == name and s.labels == labels]
    assert len(found) == 1, (name, labels, metrics.text())
    return float(found[0])


def test_every_end_of_an_attempt_is_counted_once_with_its_duration() -> None:
    metrics, clock = AgentMetrics(), Clock()
    where = {"namespace": "ns", "queue": "mail"}
    task = _claim(metrics, clock)
    clock.now += 4
    task.complete("ok")
    failed = _claim(metrics, clock)
    failed.fail("boom")
    released = _claim(metrics, clock)
    released.release()
    lost = _claim(metrics, clock)
    lost._lose("expired")
    lost._lose("expired again")  # one loss, one count
    assert _value(metrics, "tasklease_agent_claims_total", **where) == 4
    for name in ("completions", "failures", "releases", "lost_leases"):
        assert _value(metrics, f"tasklease_agent_{name}_total", **where) == 1, name
    assert _value(metrics, "tasklease_agent_handler_seconds_sum", **where, outcome="completed") == 4
    assert _value(metrics, "tasklease_agent_handler_seconds_bucket", **where, outcome="completed", le="5.0") == 1
    assert _value(metrics, "tasklease_agent_handler_seconds_bucket", **where, outcome="completed", le="2.0") == 0


def test_a_completion_refused_as_lost_counts_as_a_lost_lease() -> None:
    metrics, clock = AgentMetrics(), Clock()
    task = _claim(metrics, clock, Writes(lose_on_complete=True))
    with pytest.raises(errors.LostLease):
        task.complete("too late")
    assert _value(metrics, "tasklease_agent_lost_leases_total", namespace="ns", queue="mail") == 1
    assert "tasklease_agent_completions_total{" not in metrics.text()


def test_two_agents_keep_their_counts_apart() -> None:
    one, two = AgentMetrics(), AgentMetrics()
    _claim(one, Clock()).complete("ok")
    assert "tasklease_agent_claims_total{" not in two.text()


def test_without_prometheus_client_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real = builtins.__import__

    def no_prometheus(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("prometheus_client"):
            raise ImportError(name)
        return real(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_prometheus)
    with pytest.raises(errors.Invalid, match=r"pip install 'tasklease\[metrics\]'"):
        AgentMetrics()


def test_tasklease_run_serves_its_metrics(cluster: Cluster, namespace: str, tmp_path: Path) -> None:
    kube = cluster.kube(namespace)
    for name in ("ok", "bad"):
        make_task(kube, name, queue="m", payload={"exit": 0 if name == "ok" else 3})
    port = free_port()
    kubeconfig = cluster.namespaced_kubeconfig(namespace, tmp_path)
    run = subprocess.Popen(tasklease_cmd("run", "--queue", "m", "--loop", f"--kubeconfig={kubeconfig}",
                                         "--metrics-port", str(port), "--metrics-host", "127.0.0.1", "--",
                                         "sh", "-c", 'case "$TASKLEASE_PAYLOAD" in *3*) exit 3;; esac'),
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        def scraped() -> str:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
                    text = resp.read().decode()
            except OSError:
                return ""
            done = f'tasklease_agent_completions_total{{namespace="{namespace}",queue="m"}} 1.0'
            failed = f'tasklease_agent_failures_total{{namespace="{namespace}",queue="m"}} 1.0'
            # The handler's time is observed just after its counter: wait for both.
            return text if done in text and failed in text and 'outcome="completed"' in text else ""
        text = wait_for(scraped, timeout=60, interval=0.2, message="the run's metrics")
        assert f'tasklease_agent_claims_total{{namespace="{namespace}",queue="m"}} 2.0' in text
        assert 'outcome="completed"' in text and "tasklease_agent_handler_seconds_count" in text
    finally:
        run.terminate()
        run.wait(30)


def test_a_metrics_port_in_use_is_one_line(cluster: Cluster, namespace: str, tmp_path: Path) -> None:
    port = AgentMetrics().serve(0, "127.0.0.1")  # the port taken, by a metrics server of our own
    kubeconfig = cluster.namespaced_kubeconfig(namespace, tmp_path)
    done = subprocess.run(tasklease_cmd("run", "--queue", "m", "--metrics-port", str(port), "--metrics-host",
                                        "127.0.0.1", f"--kubeconfig={kubeconfig}", "--", "true"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 9 and "Traceback" not in done.stderr, done.stderr
    assert f"--metrics-port {port}:" in done.stderr

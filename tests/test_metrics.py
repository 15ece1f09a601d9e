"""The operator's metrics and readiness: labels, zero series, the new histograms and
gauges against a real API server, and /readyz when a watch cannot work."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from conftest import Cluster, Operator, make_task, service_account_kubeconfig, tasklease_cmd, wait_for
from tasklease.api import rbac
from tasklease.operator.health import WatchHealth


def _series(op: Operator) -> list[str]:
    return [line for line in op.get("/metrics")[1].splitlines() if line and not line.startswith("#")]


def test_per_queue_series_have_the_namespace_start_at_zero_and_grow(
        cluster: Cluster, namespace: str, operator: Operator, tmp_path: Path) -> None:
    import os
    import subprocess

    make_task(cluster.kube(namespace), "m1", queue="metered")
    where = f'namespace="{namespace}",queue="metered"'
    ns, q = f'namespace="{namespace}"', 'queue="metered"'  # the exposition sorts labels by name
    # The series are made one after another: wait for one of the last made.
    wait_for(lambda: f'tasklease_expirations_total{{cause="container-restarted",{where}}} 0.0' in _series(operator),
             message="the queue's series at zero")
    series = _series(operator)
    assert not [s for s in series if "_created" in s]
    assert not [s for s in series if 'phase="DeadLettered"' in s]
    for name in ("tasklease_claims_total", "tasklease_requeues_total", "tasklease_queue_wait_seconds_count"):
        assert f"{name}{{{where}}} 0.0" in series, name
    assert f'tasklease_expirations_total{{cause="timeout",{where}}} 0.0' in series
    # The phase gauge follows the (coalesced) status projection, a moment after the task arrives.
    wait_for(lambda: f'tasklease_tasks{{{ns},phase="Pending",{q}}} 1.0' in _series(operator),
             message="the task counted as Pending")
    oldest = f"tasklease_oldest_pending_seconds{{{where}}}"
    wait_for(lambda: [s for s in _series(operator) if s.startswith(oldest) and float(s.rsplit(" ", 1)[1]) > 0],
             message="an oldest pending age")

    config = cluster.namespaced_kubeconfig(namespace, tmp_path)
    ran = subprocess.run(tasklease_cmd("run", "--queue", "metered", "--", "true"), capture_output=True, text=True,
                         timeout=60, env={**os.environ, "KUBECONFIG": str(config)})
    assert ran.returncode == 0, ran.stderr
    wait_for(lambda: f'tasklease_completions_total{{{ns},phase="Succeeded",{q}}} 1.0' in _series(operator),
             message="the completion counted")
    series = _series(operator)
    assert f"tasklease_claims_total{{{where}}} 1.0" in series
    assert f"tasklease_queue_wait_seconds_count{{{where}}} 1.0" in series
    assert f'tasklease_run_seconds_count{{{ns},outcome="Succeeded",{q}}} 1.0' in series
    assert f"tasklease_oldest_pending_seconds{{{where}}} 0.0" in series


def test_readyz_says_which_watch_cannot_work(cluster: Cluster, namespace: str, chart_roles: dict[str, str],
                                             operator_factory: Callable[..., Operator], tmp_path: Path) -> None:
    """An operator whose role may not watch Tasks starts, but is not ready, and says why."""
    import yaml

    role = f"{namespace}-no-tasks"
    rules = [r for r in rbac.OPERATOR if "tasks" not in r["resources"]]
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": role},
        "rules": rules}))
    try:
        config = service_account_kubeconfig(cluster, namespace, "blind-operator", role, tmp_path)
        op = Operator(config, namespace, tmp_path / "blind.log", "--no-leader-elect")
        try:
            # It leads (no election) but stays unready: a standby's message could come first.
            code, body = wait_for(lambda: (r := op.get("/readyz"))[0] == 503 and "not ready (leader)" in r[1]
                                  and r, timeout=60, message=f"an unready leader; log:\n{op.output()[-2000:]}")
            assert "tasks" in body
        finally:
            op.stop()
    finally:
        cluster.kubectl("delete", "clusterrole", role, check=False)


def test_watch_health_forgets_a_request_failure_after_a_quiet_period_but_not_an_unwatched_kind() -> None:
    now = [0.0]
    health = WatchHealth(quiet_s=30, monotonic=lambda: now[0])
    assert health.problem() is None
    health.request_failed("Request attempt 1 failed; will retry")
    assert health.problem() == "Request attempt 1 failed; will retry"
    now[0] = 31
    assert health.problem() is None
    health.cannot_watch("Not enough permissions to watch for resources")
    now[0] = 1000
    assert health.problem() == "Not enough permissions to watch for resources"
    health.event()
    assert health.problem() is None


def test_watch_health_names_a_reflector_that_a_refusal_stopped(cluster: Cluster, namespace: str,
                                                                tmp_path: Path) -> None:
    """Our own Task and Lease watches: one stopped for good keeps the operator unready, saying which."""
    from tasklease.kube import LEASES, Kube
    from tasklease.kube.watching import Reflector

    nobody = Kube.connect(kubeconfig=str(service_account_kubeconfig(cluster, namespace, "reflect-nobody",
                                                                    "no-such-role", tmp_path)))
    health = WatchHealth()
    reflector = Reflector(nobody, LEASES, namespace=namespace, listener=lambda kind, obj: None)
    health.track([reflector])
    assert health.problem() is None and not health.synced()
    reflector.start()
    problem = wait_for(health.problem, timeout=30, message="the stopped watch reported")
    assert problem.startswith("cannot watch leases: ") and "forbidden" in problem.lower(), problem
    assert health.stopped() == [reflector]
    health.reset()  # a restart does not revive this one: only new Reflectors replace it
    assert health.problem() == problem


def _helm_template(*sets: str) -> list[dict[str, object]]:
    import subprocess

    import yaml

    from conftest import ROOT
    from tasklease_dev import binaries

    args = [a for s in sets for a in ("--set", s)]
    out = subprocess.run([str(binaries.ensure_helm()), "template", "t", str(ROOT / "helm" / "tasklease"), *args,
                          "--kube-version", binaries.KUBERNETES_VERSION],
                         check=True, capture_output=True, text=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_the_opt_in_dashboard_only_queries_metrics_the_operator_exports() -> None:
    import json
    import re

    from tasklease.operator import metrics

    assert not [d for d in _helm_template() if d["kind"] == "ConfigMap"]
    maps = [d for d in _helm_template("grafanaDashboard.enabled=true") if d["kind"] == "ConfigMap"]
    assert len(maps) == 1 and maps[0]["metadata"]["labels"]["grafana_dashboard"] == "1"  # type: ignore[index]
    dashboard = json.loads(maps[0]["data"]["tasklease.json"])  # type: ignore[index]
    metrics.known_queue("ns", "q")  # labelled metrics show samples once a queue is known
    metrics.STATUS_WRITES.labels("ok")
    metrics.OLDEST_PENDING.source = lambda: [("ns", "q", 0.0)]
    metrics.CLAIMABLE.source = lambda: [("ns", "q", 0, 0.0)]
    exported = {s.name for family in metrics.REGISTRY.collect() for s in family.samples}
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\btasklease_[a-z_]+", e)}
    assert used and used <= exported, used - exported


def test_the_chart_passes_the_default_ttl_to_the_operator() -> None:
    def args(*sets: str) -> list[str]:
        deployment = next(d for d in _helm_template(*sets) if d["kind"] == "Deployment")
        return list(deployment["spec"]["template"]["spec"]["containers"][0]["args"])  # type: ignore[index]
    assert not [a for a in args() if a.startswith("--ttl")]
    assert "--ttl-seconds-after-finished=600" in args("operator.ttlSecondsAfterFinished=600")

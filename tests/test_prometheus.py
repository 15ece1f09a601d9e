"""A real Prometheus (Debian's) on 127.0.0.1 scrapes a running operator, as the chart's
ServiceMonitor would have it (job tasklease-operator, the operator's labels kept), and runs
the alert rules: every dashboard query and every alert expression is evaluated through its
HTTP API. A dashboard query must return data; an alert expression must be valid, every
series it selects must exist, and Prometheus must evaluate its rule without error."""

from __future__ import annotations

import json
import os
import re
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import ROOT, Cluster, Operator, Process, free_port, make_task, tasklease_cmd, wait_for
from promtools import need
from test_alerts import JOB, RULES
from test_chart import by_kind, render

DASHBOARD = ROOT / "helm" / "tasklease" / "dashboards" / "tasklease.json"
QUEUE = "scraped"
# A metric name and its label matchers, as PromQL writes a series selector.
_SELECTOR = re.compile(r"\b(tasklease_[a-z_]+|up)\b(\{[^}]*\})?")


class Prometheus(Process):
    def __init__(self, workdir: Path, target_port: int) -> None:
        self.port = free_port()
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                  "rule_files": [str(RULES)],
                  "scrape_configs": [{"job_name": JOB, "honor_labels": True,
                                      "static_configs": [{"targets": [f"127.0.0.1:{target_port}"]}]}]}
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        super().__init__([need("prometheus"), f"--config.file={workdir / 'prometheus.yml'}",
                          f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}"],
                         log=workdir / "prometheus.log")

    def api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                return json.load(resp)
        except urllib.error.HTTPError as exc:
            if exc.code not in (400, 422):  # 503 "Service Unavailable" while it starts: not answering yet
                raise
            return json.load(exc)  # a bad query: Prometheus's reason

    def query(self, expr: str) -> list[dict[str, Any]]:
        answer = self.api("query", query=expr)
        assert answer["status"] == "success", f"{expr}: {answer.get('error')}"
        return list(answer["data"]["result"])

    def values(self, expr: str) -> list[float]:
        try:
            return [float(r["value"][1]) for r in self.query(expr)]
        except (AssertionError, OSError):
            return []


@pytest.fixture
def prometheus(operator: Operator, tmp_path: Path) -> Iterator[Prometheus]:
    prom = Prometheus(tmp_path, operator.port)
    try:
        wait_for(lambda: prom.values(f'up{{job="{JOB}"}}') == [1.0], timeout=60,
                 message=f"Prometheus scraping the operator; log:\n{prom.output()[-2000:]}")
        yield prom
    finally:
        prom.stop()


def test_every_dashboard_query_returns_data_and_every_alert_is_evaluated(
        cluster: Cluster, namespace: str, operator: Operator, prometheus: Prometheus, tmp_path: Path) -> None:
    kube = cluster.kube(namespace)
    config = cluster.namespaced_kubeconfig(namespace, tmp_path)
    make_task(kube, "done", queue=QUEUE)
    ran = subprocess.run(tasklease_cmd("run", "--queue", QUEUE, "--", "true"), capture_output=True, text=True,
                         timeout=60, env={**os.environ, "KUBECONFIG": str(config)})
    assert ran.returncode == 0, ran.stderr
    make_task(kube, "waiting", queue=QUEUE)
    later = (datetime.now(UTC) + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    make_task(kube, "scheduled", queue=QUEUE, notBefore=later)

    where = f'namespace="{namespace}",queue="{QUEUE}"'
    # Through Prometheus, with the task's namespace kept: two Pending, one of them claimable.
    wait_for(lambda: prometheus.values(f'tasklease_tasks{{{where},phase="Pending"}}') == [2.0]
             and prometheus.values(f"tasklease_claimable_tasks{{{where}}}") == [1.0]
             and prometheus.values(f'tasklease_completions_total{{{where},phase="Succeeded"}}') == [1.0],
             timeout=60, message="the operator's gauges through Prometheus")
    assert prometheus.values(f"tasklease_oldest_claimable_seconds{{{where}}}")[0] > 0
    # rate() and increase() need two samples of each series within their window.
    wait_for(lambda: prometheus.values(f"count_over_time(tasklease_claimable_tasks{{{where}}}[5m])") >= [3.0],
             timeout=60, message="three scrapes of the queue's series")

    dashboard = json.loads(DASHBOARD.read_text())
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":  # label_values(<selector>, <label>): Grafana asks the series API
            selector, label = re.fullmatch(r"label_values\((.*), (\w+)\)", variable["definition"]).groups()  # type: ignore[union-attr]
            selector = selector.replace("$namespace", namespace)
            values = prometheus.api(f"label/{label}/values", **{"match[]": selector})["data"]
            assert {"namespace": namespace, "queue": QUEUE}[label] in values, (variable["name"], values)
    exprs = [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    for title, expr in exprs:
        concrete = expr.replace("$namespace", namespace).replace("$queue", QUEUE)
        assert prometheus.query(concrete), f"{title}: {concrete} returned nothing"

    # The chart's KEDA trigger: one claimable task, none running.
    scaled = by_kind(render("keda.enabled=true", f"keda.queue={QUEUE}", f"keda.taskNamespace={namespace}"),
                     "ScaledObject")[0]
    assert prometheus.values(scaled["spec"]["triggers"][0]["metadata"]["query"]) == [1.0]

    alerts = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    for rule in alerts:
        prometheus.query(rule["expr"])  # valid (an alert that does not fire returns nothing)
        for name, matchers in _SELECTOR.findall(rule["expr"]):
            assert prometheus.query(f"count({name}{matchers})"), f"{rule['alert']}: no series {name}{matchers}"
    # And Prometheus evaluates each rule itself, without error.
    wait_for(lambda: len(_evaluated(prometheus)) == len(alerts), timeout=30,
             message="every rule evaluated at least once")
    assert all(r["health"] == "ok" for r in _evaluated(prometheus)), _evaluated(prometheus)
    firing = {r["name"] for r in _evaluated(prometheus) if r["state"] != "inactive"}
    assert not firing, firing  # a healthy operator with a served queue raises nothing


def _evaluated(prometheus: Prometheus) -> list[dict[str, Any]]:
    return [r for g in prometheus.api("rules")["data"]["groups"] for r in g["rules"]
            if r["health"] != "unknown" and not r.get("lastEvaluation", "0001").startswith("0001")]

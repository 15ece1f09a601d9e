"""The chart's alerts (helm/tasklease/alerts/tasklease.rules.yaml): valid for promtool, each
one covered by a `promtool test rules` case that fires it, and rendered by the chart as they
are, from that one file."""

from __future__ import annotations

import subprocess

import yaml

from conftest import ROOT
from promtools import need
from test_chart import by_kind, render

RULES = ROOT / "helm" / "tasklease" / "alerts" / "tasklease.rules.yaml"
TESTS = ROOT / "tests" / "alerts" / "tasklease.rules.test.yaml"
JOB = "tasklease-operator"


def _alerts() -> list[dict[str, object]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]


def test_promtool_checks_the_rules_and_passes_every_unit_test() -> None:
    promtool = need("promtool")
    checked = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run([promtool, "test", "rules", str(TESTS)], capture_output=True, text=True)
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr


def test_every_alert_has_a_unit_test_that_fires_it() -> None:
    fired = {t["alertname"] for case in yaml.safe_load(TESTS.read_text())["tests"]
             for t in case.get("alert_rule_test", []) if t.get("exp_alerts")}
    names = {str(a["alert"]) for a in _alerts()}
    assert {"TaskleaseNoLeader", "TaskleaseOperatorDown", "TaskleaseDeadLetters", "TaskleaseExpirySpike",
            "TaskleaseQueueStalled", "TaskleaseProjectionFailing"} <= names
    assert names <= fired, names - fired
    for alert in _alerts():
        assert {"summary", "description"} <= set(alert["annotations"]), alert["alert"]  # type: ignore[arg-type]
        assert alert["labels"]["severity"] in ("warning", "critical"), alert["alert"]  # type: ignore[index]


def test_the_chart_renders_the_rule_file_as_it_is_only_when_asked() -> None:
    assert not by_kind(render(), "PrometheusRule")
    rule = by_kind(render("prometheusRule.enabled=true", "prometheusRule.labels.release=kps"), "PrometheusRule")
    assert len(rule) == 1 and rule[0]["metadata"]["labels"]["release"] == "kps"
    assert rule[0]["spec"] == yaml.safe_load(RULES.read_text())


def test_the_service_monitor_keeps_the_operators_labels_and_names_the_job_the_alerts_use() -> None:
    monitor = by_kind(render("metrics.serviceMonitor.enabled=true"), "ServiceMonitor")[0]
    endpoint = monitor["spec"]["endpoints"][0]
    # Without honorLabels Prometheus renames the series' own `namespace` to exported_namespace.
    assert endpoint["honorLabels"] is True
    assert {"targetLabel": "job", "replacement": JOB} in endpoint["relabelings"]
    assert f'job="{JOB}"' in RULES.read_text()

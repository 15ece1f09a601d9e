"""The CRD, the chart and the RBAC rules are generated from one source and cannot drift."""

from __future__ import annotations

import subprocess

from conftest import ROOT, Cluster, make_task
from tasklease.api import crd, models, rbac
from tasklease.kube import Kube


def test_checked_in_crds_are_generated_from_the_models() -> None:
    for path, expected in crd.generated(ROOT).items():
        assert path.read_text() == expected, f"{path} is stale: run `make generate`"


def test_chart_rbac_rules_are_generated_from_rbac_py() -> None:
    assert rbac.target(ROOT).read_text() == rbac.render(), "helm rules are stale: run `make generate`"


def test_api_server_defaults_equal_the_model_defaults(kube: Kube) -> None:
    created = make_task(kube, "defaults", queue="q")
    assert created["spec"] == models.TaskSpec(queue="q").model_dump(mode="json", by_alias=True, exclude_none=True)


def test_kubectl_explain_documents_every_spec_field(cluster: Cluster) -> None:
    out = cluster.kubectl("explain", "task.spec").stdout
    for field in models.TaskSpec.model_fields.values():
        assert field.alias in out
    assert "DNS label" in out


def test_kubectl_get_tasks_shows_the_story_columns(cluster: Cluster, kube: Kube, namespace: str) -> None:
    make_task(kube, "shown", queue="mail")
    header = cluster.kubectl("get", "tasks", "-n", namespace).stdout.splitlines()[0].split()
    assert header == ["NAME", "QUEUE", "PHASE", "HOLDER", "ATTEMPT", "AGE", "NOT-BEFORE"]
    wide = cluster.kubectl("get", "tasks", "-n", namespace, "-o", "wide").stdout.splitlines()[0].split()
    assert wide[:7] == header and "PRIORITY" in wide and "REASON" in wide
    # No operator runs here: a Task nobody has written shows the CRD's default phase.
    row = cluster.kubectl("get", "task", "shown", "-n", namespace, "--no-headers").stdout.split()
    assert row[1:3] == ["mail", "Pending"]


def test_the_chart_lints_and_applies_to_a_real_api_server(cluster: Cluster, namespace: str) -> None:
    from tasklease_dev import binaries

    helm = str(binaries.ensure_helm())
    chart = str(ROOT / "helm" / "tasklease")
    subprocess.run([helm, "lint", chart], check=True, capture_output=True)
    rendered = subprocess.run([helm, "template", "lint-check", chart, "--namespace", namespace,
                               "--kube-version", binaries.KUBERNETES_VERSION,
                               "--skip-tests"],  # `helm test`'s Pod names a ServiceAccount a dry run never makes
                              check=True, capture_output=True, text=True).stdout
    applied = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=rendered)
    assert "deployment.apps/lint-check-operator created (server dry run)" in applied.stdout

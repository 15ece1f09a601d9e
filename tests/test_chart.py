"""The Helm chart's conventions, rendered by the real helm (no cluster): labels, schema, knobs."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import ROOT
from tasklease_dev import binaries

CHART = ROOT / "helm" / "tasklease"


def _helm(*args: str) -> subprocess.CompletedProcess[str]:
    # Offline, `helm template` assumes an old Kubernetes, which the chart's kubeVersion refuses.
    offline = ["--kube-version", binaries.KUBERNETES_VERSION] if args[0] == "template" else []
    return subprocess.run([str(binaries.ensure_helm()), *args, *offline], capture_output=True, text=True)


def render(*sets: str, release: str = "rel", values: Path | None = None) -> list[dict[str, Any]]:
    done = _helm("template", release, str(CHART), "-n", "ops", *[a for s in sets for a in ("--set", s)],
                 *(["-f", str(values)] if values else []))
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def test_lint_strict_is_clean() -> None:
    done = _helm("lint", "--strict", str(CHART))
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("bad", ["operator.replica=1", "operator.replicas=two", "hostnetwork=true",
                                 "image.digest=latest", "operator.logLevel=loud", "crds.keepIt=true"])
def test_the_schema_rejects_typos_and_wrong_types(bad: str) -> None:
    done = _helm("template", "rel", str(CHART), "--set", bad)
    assert done.returncode != 0 and "schema" in done.stderr, done.stderr


def test_every_object_and_pod_template_carries_the_standard_labels() -> None:
    docs = render("metrics.serviceMonitor.enabled=true", "prometheusRule.enabled=true", "keda.enabled=true")
    wanted = {"helm.sh/chart", "app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version",
              "app.kubernetes.io/managed-by"}
    for doc in docs:
        assert wanted <= set(doc["metadata"].get("labels", {})), f"{doc['kind']}/{doc['metadata']['name']}"
    pod = by_kind(docs, "Deployment")[0]["spec"]["template"]
    assert wanted <= set(pod["metadata"]["labels"])
    assert by_kind(docs, "ServiceMonitor") and by_kind(docs, "PrometheusRule") and by_kind(docs, "ScaledObject")


def test_pods_are_restricted_with_seccomp_and_a_group() -> None:
    pod = by_kind(render(), "Deployment")[0]["spec"]["template"]["spec"]
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["securityContext"]["runAsGroup"] == 65532 and pod["securityContext"]["runAsNonRoot"]
    container = pod["containers"][0]["securityContext"]
    assert container["allowPrivilegeEscalation"] is False and container["capabilities"] == {"drop": ["ALL"]}


def test_the_crd_is_a_template_kept_on_uninstall_or_left_out() -> None:
    crd = by_kind(render(), "CustomResourceDefinition")
    assert crd and crd[0]["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert "annotations" not in by_kind(render("crds.keep=false"), "CustomResourceDefinition")[0]["metadata"]
    assert not by_kind(render("crds.enabled=false"), "CustomResourceDefinition")
    assert not (CHART / "crds").exists(), "a crds/ folder is installed once and never upgraded"


def test_a_pdb_only_with_more_than_one_replica() -> None:
    pdb = by_kind(render(), "PodDisruptionBudget")
    assert pdb and pdb[0]["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"  # a crash loop holds no drain up
    assert not by_kind(render("operator.replicas=1"), "PodDisruptionBudget")


def test_replicas_without_an_election_are_refused() -> None:
    done = _helm("template", "rel", str(CHART), "--set", "operator.leaderElection.enabled=false")
    assert done.returncode != 0 and "needs operator.leaderElection.enabled" in done.stderr, done.stderr
    assert render("operator.leaderElection.enabled=false", "operator.replicas=1")
    done = _helm("template", "rel", str(CHART), "--set", "operator.leaderElection.leaseDurationSeconds=0.5")
    assert done.returncode != 0 and "schema" in done.stderr  # the operator refuses under a second


def test_large_durations_from_a_values_file_stay_integers(tmp_path: Path) -> None:
    """Helm reads a values file's numbers as floats; printed as 2.592e+06 the operator's int flags refuse them."""
    values = tmp_path / "values.yaml"
    values.write_text("operator:\n  ttlSecondsAfterFinished: 2592000\n  attemptTimeoutSeconds: 1209600\n")
    deployment = by_kind(render(values=values), "Deployment")[0]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--ttl-seconds-after-finished=2592000" in args and "--attempt-timeout=1209600" in args


def test_a_long_release_name_keeps_object_names_within_63_characters() -> None:
    names = [d["metadata"]["name"] for d in by_kind(render(release="r" * 53), "Service")]
    assert names and all(len(n) <= 63 for n in names), names


def test_watch_namespaces_gives_roles_not_cluster_wide_rights() -> None:
    docs = render("operator.watchNamespaces={a,b}")
    roles = {(r["metadata"]["namespace"], r["metadata"]["name"]) for r in by_kind(docs, "Role")
             if "helm.sh/hook" not in r["metadata"].get("annotations", {})}  # not `helm test`'s
    assert roles == {("a", "rel-operator"), ("b", "rel-operator"), ("ops", "rel-operator")}
    cluster = next(r for r in by_kind(docs, "ClusterRole") if r["metadata"]["name"] == "rel-operator")
    assert {res for rule in cluster["rules"] for res in rule["resources"]} <= {"customresourcedefinitions",
                                                                                "namespaces"}
    everywhere = next(r for r in by_kind(render(), "ClusterRole") if r["metadata"]["name"] == "rel-operator")
    assert "leases" in {res for rule in everywhere["rules"] for res in rule["resources"]}


def test_scheduling_image_and_extra_knobs_reach_the_pod() -> None:
    digest = "sha256:" + "a" * 64
    pod_template = by_kind(render(
        f"image.digest={digest}", "imagePullSecrets[0].name=regcred", "operator.nodeSelector.disk=ssd",
        "operator.tolerations[0].operator=Exists", "operator.priorityClassName=high",
        "operator.affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].weight=1",
        "operator.topologySpreadConstraints[0].maxSkew=1", "operator.podAnnotations.team=infra",
        "operator.extraEnv[0].name=EXTRA", "operator.extraEnv[0].value=on", "operator.extraArgs[0]=--verbose",
    ), "Deployment")[0]["spec"]["template"]
    pod = pod_template["spec"]
    container = pod["containers"][0]
    assert container["image"] == f"tasklease@{digest}"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}] and pod["nodeSelector"] == {"disk": "ssd"}
    assert pod["tolerations"] and pod["affinity"] and pod["topologySpreadConstraints"]
    assert pod["priorityClassName"] == "high" and pod_template["metadata"]["annotations"] == {"team": "infra"}
    assert {"name": "EXTRA", "value": "on"} in container["env"] and container["args"][-1] == "--verbose"


def test_host_network_values_keep_the_pods_on_loopback() -> None:
    pod = by_kind(render("hostNetwork=true", "apiServer.host=127.0.0.1", "apiServer.port=6443",
                         "operator.httpHost=127.0.0.1"), "Deployment")[0]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert pod["hostNetwork"] is True
    assert env["KUBERNETES_SERVICE_HOST"] == "127.0.0.1" and env["KUBERNETES_SERVICE_PORT"] == "6443"
    assert "--http-host=127.0.0.1" in container["args"]
    assert container["readinessProbe"]["httpGet"]["host"] == "127.0.0.1"
    assert container["livenessProbe"]["httpGet"]["host"] == "127.0.0.1"
    default = by_kind(render(), "Deployment")[0]["spec"]["template"]["spec"]
    assert "hostNetwork" not in default and "host" not in default["containers"][0]["readinessProbe"]["httpGet"]


def test_no_helm_test_where_the_operator_watches_not_the_release_namespace() -> None:
    def hooks(*sets: str) -> list[dict[str, Any]]:
        return [d for d in render(*sets) if d["metadata"].get("annotations", {}).get("helm.sh/hook") == "test"]
    assert not hooks("operator.watchNamespaces={a,b}")  # its Task would never be projected
    assert hooks("operator.watchNamespaces={a,ops}") and hooks()


def test_helm_test_checks_the_operator_and_a_task_round_trip_with_its_own_rights() -> None:
    hooks = [d for d in render("hostNetwork=true", "apiServer.host=127.0.0.1", "apiServer.port=6443")
             if d["metadata"].get("annotations", {}).get("helm.sh/hook") == "test"]
    assert sorted(d["kind"] for d in hooks) == ["Pod", "Role", "RoleBinding", "ServiceAccount"]
    pod = by_kind(hooks, "Pod")[0]["spec"]
    container = pod["containers"][0]
    assert pod["serviceAccountName"] == "rel-operator-test" and pod["restartPolicy"] == "Never"
    assert container["image"] == f"tasklease:{yaml.safe_load((CHART / 'Chart.yaml').read_text())['appVersion']}"
    assert {"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"} in container["env"] and pod["hostNetwork"]
    script = container["args"][0]
    compile(script, "helm-test", "exec")
    assert "ready_replicas" in script and "agent.claim(" in script and "producer.wait(" in script
    rules = by_kind(hooks, "Role")[0]["rules"]
    assert {"apiGroups": ["tasklease.dev"], "resources": ["tasks"], "verbs": ["create", "delete"]} in rules


def test_service_accounts_carry_their_annotations() -> None:
    docs = render("operator.serviceAccount.annotations.team=ops",
                  "agents.serviceAccount.annotations.eks\\.amazonaws\\.com/role-arn=arn:aws:iam::1:role/agents",
                  "agents.namespaces={a,b}")
    accounts = {(d["metadata"]["namespace"], d["metadata"]["name"]): d["metadata"].get("annotations", {})
                for d in by_kind(docs, "ServiceAccount") if "helm.sh/hook" not in d["metadata"].get("annotations", {})}
    assert accounts[("ops", "rel-operator")] == {"team": "ops"}
    for ns in ("a", "b"):
        assert accounts[(ns, "tasklease-agent")] == {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/agents"}


def test_the_chart_readme_is_generated_from_values_yaml() -> None:
    from tasklease_dev import chartdoc

    assert (CHART / "README.md").read_text() == chartdoc.render(), "helm/tasklease/README.md is stale: make generate"
    documented = {key for key, _, _ in chartdoc.rows((CHART / "values.yaml").read_text())}
    assert {"image.tag", "operator.serviceAccount.annotations", "agents.serviceAccount.annotations"} <= documented

"""KEDA and the chart's ScaledObject, with the KEDA release `binaries.KEDA_VERSION` pins, from
its Go module (into the Go module cache and the binary cache, outside the clone):

- KEDA's CRDs, served by the test API server, validate the rendered ScaledObject strictly
  (unknown fields and wrong types refused);
- KEDA's operator, built from the module and run on 127.0.0.1 against the test control plane,
  scales the example agents' Deployment from zero to one and back on the chart's trigger,
  a query to a real Prometheus that scrapes a real tasklease operator."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import ROOT, Cluster, Operator, Process, free_port, make_task, tasklease_cmd, wait_for
from tasklease.kube import Resource
from tasklease_dev import binaries
from test_chart import CHART, _helm, by_kind, render
from test_prometheus import Prometheus

DEPLOYMENTS = Resource("apps", "v1", "deployments")
SCALEDOBJECTS = Resource("keda.sh", "v1alpha1", "scaledobjects")
EVENTS = Resource("", "v1", "events")
QUEUE = "thumbnails"


@pytest.fixture(scope="module")
def keda_crd(cluster: Cluster) -> None:
    """All of KEDA's CRDs: its operator watches every kind they define."""
    try:
        bases = binaries.keda_module_dir() / "config" / "crd" / "bases"
    except RuntimeError as exc:  # no Go toolchain or no Go module proxy: no KEDA to be had
        pytest.skip(str(exc))
    cluster.kubectl("apply", "--server-side", "-f", str(bases))
    names = [yaml.safe_load(f.read_text())["metadata"]["name"] for f in sorted(bases.glob("*.yaml"))]
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", *[f"crd/{n}" for n in names])


class Keda(Process):
    """KEDA's operator as a host process on 127.0.0.1, watching one namespace. Its metrics
    gRPC service (for KEDA's metrics adapter, not run here) wants a TLS key pair."""

    def __init__(self, binary: Path, kubeconfig: Path, namespace: str, workdir: Path) -> None:
        certs = workdir / "keda-certs"
        certs.mkdir()
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                        "-subj", "/CN=keda-operator", "-addext", "subjectAltName=IP:127.0.0.1",
                        "-keyout", str(certs / "tls.key"), "-out", str(certs / "tls.crt")],
                       check=True, capture_output=True)
        shutil.copy(certs / "tls.crt", certs / "ca.crt")
        self.probe_port = free_port()
        super().__init__([str(binary), f"--metrics-bind-address=127.0.0.1:{free_port()}",
                          f"--health-probe-bind-address=127.0.0.1:{self.probe_port}",
                          f"--metrics-service-bind-address=127.0.0.1:{free_port()}",
                          f"--cert-dir={certs}", f"--ca-dir={certs}"],
                         log=workdir / "keda.log",
                         env={"KUBECONFIG": str(kubeconfig), "WATCH_NAMESPACE": namespace,
                              "POD_NAMESPACE": namespace, "KEDA_CLUSTER_OBJECT_NAMESPACE": namespace})

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.probe_port}/readyz", timeout=2) as resp:
                return resp.status == 200
        except OSError:  # not listening yet (URLError and HTTPError are OSErrors)
            return False


@pytest.fixture
def keda(cluster: Cluster, namespace: str, keda_crd: None, tmp_path: Path) -> Iterator[Keda]:
    try:
        binary = binaries.ensure_keda()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    started = Keda(binary, cluster.kubeconfig, namespace, tmp_path)
    try:
        wait_for(lambda: started.ready() or started.proc.poll() is not None, timeout=60,
                 message="KEDA's operator ready")
        assert started.proc.poll() is None, started.output()[-3000:]
        yield started
    finally:
        started.stop()


def _server_validates(cluster: Cluster, namespace: str, obj: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    return cluster.kubectl("apply", "--dry-run=server", "--validate=strict", "-n", namespace, "-f", "-",
                           input=yaml.safe_dump(obj), check=False)


def _scaled_object(namespace: str, *sets: str) -> dict[str, Any]:
    objs = by_kind(render("keda.enabled=true", f"keda.taskNamespace={namespace}", *sets), "ScaledObject")
    assert len(objs) == 1
    objs[0]["metadata"]["namespace"] = namespace
    return objs[0]


def test_the_scaled_object_is_opt_in_and_valid_for_kedas_crd(cluster: Cluster, namespace: str,
                                                              keda_crd: None) -> None:
    assert not by_kind(render(), "ScaledObject")
    obj = _scaled_object(namespace, "keda.queue=emails", "keda.maxReplicas=4", "keda.tasksPerReplica=2")
    done = wait_for(lambda: (r := _server_validates(cluster, namespace, obj)).returncode == 0 and r, timeout=30,
                    message="the ScaledObject accepted (the CRD just established)")
    assert "created (server dry run)" in done.stdout, done.stdout
    spec = obj["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "thumbnail-agents"}
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (0, 4)
    trigger = spec["triggers"][0]
    assert trigger["type"] == "prometheus" and trigger["metadata"]["threshold"] == "2"
    assert trigger["metadata"]["ignoreNullValues"] == "false"  # no operator metrics: an error, not zero
    assert f'tasklease_claimable_tasks{{namespace="{namespace}",queue="emails"}}' in trigger["metadata"]["query"]

    # The check is real: KEDA's schema refuses what it does not know and what has the wrong type.
    typo = json.loads(json.dumps(obj))
    typo["spec"]["triggers"][0]["metdata"] = typo["spec"]["triggers"][0].pop("metadata")
    refused = _server_validates(cluster, namespace, typo)
    assert refused.returncode != 0 and "metdata" in refused.stderr, refused.stderr
    wrong = json.loads(json.dumps(obj))
    wrong["spec"]["maxReplicaCount"] = "ten"
    refused = _server_validates(cluster, namespace, wrong)
    assert refused.returncode != 0 and "maxReplicaCount" in refused.stderr, refused.stderr


def test_the_chart_refuses_more_minimum_than_maximum_replicas() -> None:
    done = _helm("template", "rel", str(CHART), "--set", "keda.enabled=true", "--set", "keda.minReplicas=5",
                 "--set", "keda.maxReplicas=2")
    assert done.returncode != 0 and "keda.minReplicas must not exceed keda.maxReplicas" in done.stderr


class _Scaled:
    """The example agents' Deployment at zero replicas, scaled by the chart's ScaledObject whose
    trigger queries a real Prometheus scraping `operator`, polled every second."""

    def __init__(self, cluster: Cluster, namespace: str, operator: Operator, keda: Keda, tmp_path: Path) -> None:
        self.kube, self.keda = cluster.kube(namespace), keda
        agents = yaml.safe_load((ROOT / "examples" / "agent-deployment.yaml").read_text())
        agents["spec"]["replicas"] = 0
        self.kube.create(DEPLOYMENTS, agents)
        self.name = agents["metadata"]["name"]
        self.prometheus = Prometheus(tmp_path, operator.port)
        try:
            wait_for(lambda: self.prometheus.values("tasklease_build_info") != [], timeout=60,
                     message=f"Prometheus scraping the operator; log:\n{self.prometheus.output()[-2000:]}")
            scaled = _scaled_object(namespace, f"keda.queue={QUEUE}", "keda.pollingInterval=1",
                                    "keda.cooldownPeriod=1", f"keda.prometheusAddress=http://127.0.0.1:{self.prometheus.port}")
            assert scaled["spec"]["scaleTargetRef"]["name"] == self.name
            cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(scaled))
            # KEDA has polled the trigger (Ready) and found no work (not Active): the agents stay at zero.
            wait_for(lambda: self.condition("Ready") == "True" and self.condition("Active") == "False", timeout=60,
                     message=f"KEDA taking the ScaledObject on; its log:\n{keda.output()[-3000:]}")
            assert self.replicas() == 0
        except BaseException:
            self.prometheus.stop()
            raise

    def replicas(self) -> int:
        return int(self.kube.get(DEPLOYMENTS, self.name)["spec"]["replicas"])

    def condition(self, kind: str, field: str = "status") -> str | None:
        found = self.kube.get(SCALEDOBJECTS, self.name).get("status", {}).get("conditions", [])
        return next((c.get(field) for c in found if c["type"] == kind), None)

    def woken(self) -> None:
        """A claimable task: KEDA scales the agents from zero to one."""
        make_task(self.kube, "wake-up", queue=QUEUE)
        wait_for(lambda: self.replicas() == 1, timeout=60,
                 message=f"KEDA scaling the agents from zero; its log:\n{self.keda.output()[-3000:]}")
        # KEDA writes the condition after it has scaled: under load, a moment later.
        wait_for(lambda: self.condition("Active") == "True", timeout=30, message="KEDA's ScaledObject to say Active")


def test_real_keda_scales_the_agents_from_zero_on_claimable_work_and_back_when_it_is_done(
        cluster: Cluster, namespace: str, operator: Operator, keda: Keda, tmp_path: Path) -> None:
    scaled = _Scaled(cluster, namespace, operator, keda, tmp_path)
    kube, replicas, prometheus = scaled.kube, scaled.replicas, scaled.prometheus
    try:
        scaled.woken()

        # The work done, nothing claimable or running: back to zero after the cooldown.
        config = cluster.namespaced_kubeconfig(namespace, tmp_path)
        ran = subprocess.run(tasklease_cmd("run", "--queue", QUEUE, "--", "true"), capture_output=True, text=True,
                             timeout=60, env={**os.environ, "KUBECONFIG": str(config)})
        assert ran.returncode == 0, ran.stderr
        wait_for(lambda: replicas() == 0, timeout=60,
                 message=f"KEDA scaling the agents back to zero; its log:\n{keda.output()[-3000:]}")

        def reasons() -> set[str]:
            return {e["reason"] for e in kube.list(EVENTS)["items"] if e["involvedObject"]["kind"] == "ScaledObject"}
        wait_for(lambda: {"KEDAScaleTargetActivated", "KEDAScaleTargetDeactivated"} <= reasons(), timeout=30,
                 message="KEDA's Events on the ScaledObject")
    finally:
        prometheus.stop()


def test_real_keda_keeps_the_agents_it_has_when_the_operators_metrics_are_lost(
        cluster: Cluster, namespace: str, operator: Operator, keda: Keda, tmp_path: Path) -> None:
    scaled = _Scaled(cluster, namespace, operator, keda, tmp_path)
    try:
        scaled.woken()
        operator.stop()  # its series go stale at Prometheus's next scrape: the query is empty
        wait_for(lambda: scaled.prometheus.values("tasklease_build_info") == [], timeout=60,
                 message="Prometheus losing the operator's metrics")
        # The poll that finds the query empty is the one that would have scaled to zero.
        wait_for(lambda: scaled.condition("Ready") == "False", timeout=60,
                 message=f"KEDA reporting the trigger's error; its log:\n{keda.output()[-3000:]}")
        assert scaled.condition("Ready", "reason") == "TriggerError"
        assert scaled.replicas() == 1
    finally:
        scaled.prometheus.stop()


def test_the_build_repeats_a_modules_replaces_of_other_versions_but_not_of_local_folders() -> None:
    gomod = """module example.com/m

replace (
\texample.com/a v1.0.0 => example.com/a v1.0.1 // a fix
\texample.com/b => ./staging/b
)

replace example.com/c v0.1.0 => example.com/d v0.2.0
replace example.com/e => ../e
"""
    assert binaries.module_replaces(gomod) == ["example.com/a v1.0.0 => example.com/a v1.0.1",
                                               "example.com/c v0.1.0 => example.com/d v0.2.0"]

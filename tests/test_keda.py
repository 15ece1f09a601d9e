"""The chart's KEDA ScaledObject, checked against KEDA's own CRD: the ScaledObject schema of
the KEDA release pinned below, taken from its Go module (`go mod download`, into the Go
module cache, outside the clone), served by the test API server, which validates the
rendered object strictly (unknown fields refused). KEDA itself does not run here."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import Cluster, wait_for
from test_chart import CHART, _helm, by_kind, render

KEDA_MODULE = "github.com/kedacore/keda/v2@v2.21.0"


@pytest.fixture(scope="module")
def keda_crd(cluster: Cluster) -> None:
    go = shutil.which("go")
    if go is None:
        pytest.skip("needs the go command to fetch KEDA's CRDs from its Go module")
    fetched = subprocess.run([go, "mod", "download", "-json", KEDA_MODULE], capture_output=True, text=True,
                             cwd="/", timeout=300)
    if fetched.returncode != 0:
        pytest.skip(f"cannot download {KEDA_MODULE} from the Go module proxy: {fetched.stdout}{fetched.stderr}")
    crd = Path(json.loads(fetched.stdout)["Dir"]) / "config" / "crd" / "bases" / "keda.sh_scaledobjects.yaml"
    cluster.kubectl("apply", "--server-side", "-f", str(crd))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/scaledobjects.keda.sh")


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

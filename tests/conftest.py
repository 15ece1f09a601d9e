"""Fixtures: one real control plane for the whole session, a fresh namespace per test.

With TASKLEASE_KUBECONFIG=/path the suite runs against that cluster (kind, or any other)
and starts nothing; tests that read the local API server's audit log are skipped there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tasklease import errors
from tasklease.kube import NAMESPACES, TASKS, Kube
from tasklease.localcluster import binaries
from tasklease.localcluster.cluster import LocalCluster
from tasklease.localcluster.crds import apply_crds

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Cluster:
    kubeconfig: Path
    audit_log: Path | None  # None on an external cluster
    version: str | None  # the pinned version when we started it

    def kube(self, namespace: str = "default") -> Kube:
        return Kube.connect(kubeconfig=str(self.kubeconfig), namespace=namespace, pool_size=64)

    def kubectl(self, *args: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(binaries.ensure_kubectl()), f"--kubeconfig={self.kubeconfig}", *args],
                              capture_output=True, text=True, check=check, input=input)


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    external = os.environ.get("TASKLEASE_KUBECONFIG")
    if external:
        found = Cluster(kubeconfig=Path(external), audit_log=None, version=None)
        apply_crds(kubeconfig=found.kubeconfig, folder=ROOT / "crds")
        yield found
        return
    local = LocalCluster(ROOT / ".cache" / "test-cluster")
    state = local.up()
    try:
        apply_crds(kubeconfig=Path(state.kubeconfig), folder=ROOT / "crds")
        yield Cluster(kubeconfig=Path(state.kubeconfig), audit_log=Path(state.audit_log), version=state.version)
    finally:
        local.down()


@pytest.fixture
def audit_log(cluster: Cluster) -> Path:
    if cluster.audit_log is None:
        pytest.skip("needs the local control plane's audit log")
    return cluster.audit_log


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    kube = cluster.kube()
    kube.create(NAMESPACES, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    yield name
    try:
        kube.delete(NAMESPACES, name)
    except errors.NotFound:
        pass


@pytest.fixture
def kube(cluster: Cluster, namespace: str) -> Kube:
    return cluster.kube(namespace)


def wait_for(condition: Callable[[], Any], *, timeout: float = 30.0, interval: float = 0.1,
             message: str = "condition") -> Any:
    """Poll with a deadline: for state the test cannot watch cheaply."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {message}")
        time.sleep(interval)


def make_task(kube: Kube, name: str, *, queue: str = "q", **spec: Any) -> dict[str, Any]:
    body = {"apiVersion": "tasklease.dev/v1alpha1", "kind": "Task", "metadata": {"name": name},
            "spec": {"queue": queue, **spec}}
    return kube.create(TASKS, body)


def python_cmd(*args: str) -> list[str]:
    return [sys.executable, *args]

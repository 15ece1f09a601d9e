"""End to end on kind (`make kind-e2e`): the node e2e's scenarios on a real 2-node kind cluster.

The chart runs here with its default values: a pod network, in-cluster config through the
`kubernetes` ClusterIP and kube-proxy, CoreDNS, 2 operator replicas. What only a pod network
allows runs here too: the chart and the example agents Running under Pod Security
`restricted`, and the metrics Service scraped through its ClusterIP. The run brings the cluster
up (`make kind`) unless it runs, and at the end takes it down and compares the machine with a
snapshot taken before. kubectl and helm run in the cluster's network namespace.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import test_node_e2e as node_e2e

from conftest import ROOT, wait_for
from tasklease_dev import images, kind, kind_images
from tasklease_dev.cluster import process_alive
from test_node_e2e import AGENTS, E2E, NS, OPERATOR_SELECTOR, RELEASE

pytestmark = [pytest.mark.skipif(not os.environ.get("TASKLEASE_KIND_E2E"), reason="kind: run `make kind-e2e`"),
              pytest.mark.timeout(900)]

WORKDIR = ROOT / ".cache" / "kind"


@pytest.fixture(scope="module")
def e2e(request: pytest.FixtureRequest) -> Iterator[E2E]:
    started = time.monotonic()
    cluster = kind.KindCluster(WORKDIR, ROOT)
    kind.ensure_packages()  # installed for good: `before` can read iptables
    cluster.down()  # a fresh cluster; `before` is the machine without it
    before = kind.host_snapshot()
    cached = kind_images.server_tarball_path().exists() and images.project_archive(ROOT).exists()
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "tasklease_dev", "kind-up"], cwd=ROOT, check=True)
    make_kind_s = time.monotonic() - t0
    state = cluster.running()
    assert state is not None, "make kind did not leave a running cluster"
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "tasklease_dev", "kind-up"], cwd=ROOT, check=True)
    again = cluster.running()
    assert again is not None and again.pids == state.pids, "a second `make kind` must find the running one"
    run = E2E(kubeconfig=cluster.kubeconfig, apiserver_port=None, metrics_port=8080, before=before,
              prefix=kind.in_netns())
    run.figures["make kind"] = (f"{make_kind_s:.1f}s (binaries and images cached: {cached}); "
                                f"again, already up: {time.monotonic() - t0:.1f}s")
    node_e2e.report_figures(request, run)
    node_e2e._clean(run)
    try:
        yield run
    finally:
        if cluster.running() is not None:
            node_e2e._clean(run)
        subprocess.run([sys.executable, "-m", "tasklease_dev", "kind-down"], cwd=ROOT, check=False)
        run.figures["make kind-e2e"] = f"{time.monotonic() - started:.1f}s"


# The node e2e's scenarios, in its order, on kind's pod network.
test_operator_pod_becomes_ready_with_its_real_probes = node_e2e.test_operator_pod_becomes_ready_with_its_real_probes
test_example_agents_become_ready_with_the_chart_service_account = (
    node_e2e.test_example_agents_become_ready_with_the_chart_service_account)
test_tasks_applied_with_kubectl_all_succeed = node_e2e.test_tasks_applied_with_kubectl_all_succeed


def test_both_operator_replicas_run_and_the_metrics_service_answers_on_its_cluster_ip(e2e: E2E) -> None:
    wait_for(lambda: len(e2e.ready_pods(NS, OPERATOR_SELECTOR)) == 2, timeout=180, interval=1,
             message="the chart's 2 operator replicas Ready")
    services = e2e.json("services", "-n", NS, "-l", f"app.kubernetes.io/instance={RELEASE}")["items"]
    metrics = [s for s in services if s["metadata"]["name"].endswith("-metrics")]
    assert metrics, [s["metadata"]["name"] for s in services]
    address = f"http://{metrics[0]['spec']['clusterIP']}:{metrics[0]['spec']['ports'][0]['port']}/metrics"
    agent = e2e.ready_pods(NS, f"app.kubernetes.io/name={AGENTS}")[0]["metadata"]["name"]
    # From an agent pod, through kube-proxy's rules for the ClusterIP, to whichever operator replica.
    scrape = ("import urllib.request,sys; "
              f"sys.stdout.write(urllib.request.urlopen({address!r}, timeout=10).read().decode())")
    body = e2e.kubectl("exec", "-n", NS, agent, "--", "python3", "-c", scrape)
    assert "tasklease_" in body, body[:2000]
    e2e.figures["metrics via ClusterIP"] = f"{address}: {len(body.splitlines())} lines"


test_force_deleting_the_holder_pod_requeues_at_once = node_e2e.test_force_deleting_the_holder_pod_requeues_at_once
test_graceful_pod_deletion_releases_the_task_and_exits_within_grace = (
    node_e2e.test_graceful_pod_deletion_releases_the_task_and_exits_within_grace)
test_operator_pod_death_loses_nothing_and_completes_nothing_twice = (
    node_e2e.test_operator_pod_death_loses_nothing_and_completes_nothing_twice)
# On kind the restricted pods must be Running, not only admitted (it checks on any pod network).
test_the_chart_and_example_are_admitted_under_restricted = (
    node_e2e.test_the_chart_and_example_are_admitted_under_restricted)
test_helm_upgrade_applies_a_changed_crd = node_e2e.test_helm_upgrade_applies_a_changed_crd
test_uninstall_keeps_the_crd_and_tasks_and_nothing_else = (
    node_e2e.test_uninstall_keeps_the_crd_and_tasks_and_nothing_else)


def test_kind_down_leaves_nothing(e2e: E2E) -> None:
    cluster = kind.KindCluster(WORKDIR, ROOT)
    state = cluster.running()
    assert state is not None
    assert kind.mounts_under([WORKDIR.resolve(), kind.data_root()]), "the cluster's mounts, before"
    started = time.monotonic()
    for _ in range(2):  # idempotent
        subprocess.run([sys.executable, "-m", "tasklease_dev", "kind-down"], cwd=ROOT, check=True)
    e2e.figures["make kind-down"] = f"{time.monotonic() - started:.1f}s (twice)"
    assert not [name for name, pid in state.pids.items() if process_alive(pid)]
    assert not kind.mounts_under([WORKDIR.resolve(), kind.data_root()])
    assert kind.host_snapshot() == e2e.before  # the host's paths and their mounts among the rest
    assert not WORKDIR.exists()

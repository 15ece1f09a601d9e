"""End to end on real pods (`make e2e`): the chart, the image and the example agents on a node.

By default the run brings up `make node` (a kubelet and containerd on the local control plane,
loopback only) and removes it at the end, checking that nothing is left. With
TASKLEASE_KUBECONFIG=/path it runs the same scenarios against that cluster (kind: load the
image first with `kind load docker-image tasklease:dev`) and starts nothing.

The tests run in file order and build on each other (one release, one agent fleet).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import ROOT, wait_for
from tasklease.kube import LEASES, PODS, Kube
from tasklease.protocol import record
from tasklease_dev import binaries, dist, images, node
from tasklease_dev.cluster import LocalCluster, free_port

pytestmark = [pytest.mark.skipif(not os.environ.get("TASKLEASE_E2E"), reason="real pods: run `make e2e`"),
              pytest.mark.timeout(600)]

RELEASE = "tasklease"
NS = "tasklease-e2e"
RESTRICTED_NS = "tasklease-e2e-restricted"
DIST_NS = "tasklease-e2e-dist"
DIST_RELEASE = "dist"
AGENTS = "thumbnail-agents"
QUEUE = "thumbnails"
CHART = ROOT / "helm" / "tasklease"
EXTERNAL = os.environ.get("TASKLEASE_KUBECONFIG")
OPERATOR_SELECTOR = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=operator"


@dataclass
class E2E:
    kubeconfig: Path
    apiserver_port: int | None  # None on an external cluster: pods use the in-cluster defaults
    metrics_port: int
    figures: dict[str, str] = field(default_factory=dict)
    local: LocalCluster | None = None
    node: node.LocalNode | None = None
    before: dict[str, Any] = field(default_factory=dict)
    # Where kubectl and helm run: nothing, or how to enter kind's network namespace.
    prefix: list[str] = field(default_factory=list)

    def run_kubectl(self, *args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.prefix, str(binaries.ensure_kubectl()), f"--kubeconfig={self.kubeconfig}",
                               *args], capture_output=True, text=True, input=input, timeout=120)

    def kubectl(self, *args: str, check: bool = True, input: str | None = None) -> str:
        done = self.run_kubectl(*args, input=input)
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def json(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def helm(self, *args: str) -> str:
        done = subprocess.run([*self.prefix, str(binaries.ensure_helm()), f"--kubeconfig={self.kubeconfig}", *args],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"helm {' '.join(args)}: {done.stderr.strip()}"
        return done.stdout

    def values(self, *, host_network: bool = True, metrics_port: int | None = None,
               dev_image: bool = True) -> list[str]:
        """The chart values for this cluster: on the local node, hostNetwork and loopback only."""
        # The image `make node` builds (and kind loads): tasklease:dev; else the chart's own
        # default, the release's (`make dist`).
        common = ["--set", f"metrics.port={metrics_port or self.metrics_port}",
                  *(["--set", "image.tag=dev"] if dev_image else [])]
        if self.apiserver_port is None or not host_network:
            return common
        return common + [
            "--set", "hostNetwork=true",
            "--set", "apiServer.host=127.0.0.1", "--set", f"apiServer.port={self.apiserver_port}",
            "--set", "operator.httpHost=127.0.0.1",
            # One node: the port is the host's, so one replica and Recreate (no surge pod).
            "--set", "operator.replicas=1", "--set", "operator.strategy.type=Recreate",
            # Never a registry: the image was imported into the node's containerd.
            "--set", "image.pullPolicy=Never",
        ]

    def agents_manifest(self, *, host_network: bool = True, drain: bool = False) -> str:
        """examples/agent-deployment.yaml; on the local node with what the chart's values do for its pods.
        `drain`: `tasklease run --drain`, so that SIGTERM lets the task running finish."""
        deployment = yaml.safe_load((ROOT / "examples" / "agent-deployment.yaml").read_text())
        if drain:
            container = deployment["spec"]["template"]["spec"]["containers"][0]
            cut = container["args"].index("--")
            container["args"][cut:cut] = ["--drain", "--grace", "20"]  # within the pod's 30 s
        if self.apiserver_port is not None and host_network:
            pod = deployment["spec"]["template"]["spec"]
            pod["hostNetwork"] = True
            pod["dnsPolicy"] = "ClusterFirstWithHostNet"
            container = pod["containers"][0]
            container["imagePullPolicy"] = "Never"
            container["env"] += [{"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
                                 {"name": "KUBERNETES_SERVICE_PORT", "value": str(self.apiserver_port)}]
        return yaml.safe_dump(deployment)

    def task(self, name: str) -> dict[str, Any]:
        found: dict[str, Any] = self.json("task", name, "-n", NS)
        return found

    def apply_tasks(self, *names: str) -> None:
        template = yaml.safe_load((ROOT / "examples" / "task.yaml").read_text())
        docs = []
        for name in names:
            task = json.loads(json.dumps(template))
            task["metadata"] = {"name": name}
            task["spec"]["payload"] = {"image": f"s3://photos/{name}.png", "width": 256}
            docs.append(task)
        self.kubectl("apply", "-n", NS, "-f", "-", input=yaml.safe_dump_all(docs))

    def phase(self, name: str) -> str:
        return str(self.task(name).get("status", {}).get("phase", ""))

    def ready_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        pods = self.json("pods", "-n", namespace, "-l", selector)["items"]
        return [p for p in pods if p["metadata"].get("deletionTimestamp") is None and any(
            c["type"] == "Ready" and c["status"] == "True" for c in p.get("status", {}).get("conditions", []))]

    def operator_logs(self) -> str:
        return self.kubectl("logs", "-n", NS, "-l", OPERATOR_SELECTOR, "--tail=-1", check=False)


_BUILTIN = {f":{chain}" for chain in ("INPUT", "FORWARD", "OUTPUT", "PREROUTING", "POSTROUTING")}


def _node_snapshot() -> dict[str, Any]:
    """What the node may change on this machine, to compare after `make node-down`."""
    leaks = [*node.HOST_LEAKS, *node.SHARED_LEAKS, Path("/etc/cni"), Path("/run/runc"), Path("/var/lib/containers")]
    return {
        "sysctls": node.read_sysctls(),
        # Rules, and chains by name: a table's header and COMMIT appear once anything used it, and
        # the built-in chains' counters move on their own.
        "iptables": sorted(line.split()[0] if line.startswith(":") else line
                           for tool in ("iptables-save", "ip6tables-save")
                           for line in subprocess.run([tool], capture_output=True, text=True,
                                                      check=True).stdout.splitlines()
                           if line.startswith("-") or (line.startswith(":") and line.split()[0] not in _BUILTIN)),
        "paths": {str(p): p.exists() for p in leaks},
    }


@pytest.fixture(scope="module")
def e2e(request: pytest.FixtureRequest) -> Iterator[E2E]:
    started = time.monotonic()
    if EXTERNAL:
        run = E2E(kubeconfig=Path(EXTERNAL), apiserver_port=None, metrics_port=8080)
    else:
        local = LocalCluster(ROOT / ".cache" / "cluster", ROOT / ".cache" / "kubeconfig")
        was_running = local.running() is not None
        local_node = node.LocalNode(local, ROOT / ".cache" / "node", source=ROOT)
        node.ensure_packages()  # installed once for good (iptables too): `before` can read the rules
        local_node.down()  # a fresh node; `before` is the machine without it
        before = _node_snapshot()
        cached = (binaries.kubernetes_bin_dir() / "kubelet").exists() and images.project_archive(ROOT).exists()
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-m", "tasklease_dev", "node-up"], cwd=ROOT, check=True)
        make_node_s = time.monotonic() - t0
        state = local_node.running()
        assert state is not None, "make node did not leave a running node"
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-m", "tasklease_dev", "node-up"], cwd=ROOT, check=True)
        again = local_node.running()
        assert again is not None and again.pids == state.pids, "a second `make node` must find the running one"
        run = E2E(kubeconfig=local.kubeconfig, apiserver_port=state.apiserver_port, metrics_port=free_port(),
                  local=local, node=local_node, before=before)
        run.figures["make node"] = (f"{make_node_s:.1f}s (binaries and images cached: {cached}); "
                                    f"again, already up: {time.monotonic() - t0:.1f}s")

    report_figures(request, run)
    _clean(run)
    try:
        yield run
    finally:
        _clean(run)
        if run.node is not None and run.local is not None:
            subprocess.run([sys.executable, "-m", "tasklease_dev", "node-down"], cwd=ROOT, check=False)
            if not was_running:
                run.local.down()
        run.figures["make e2e"] = f"{time.monotonic() - started:.1f}s"


def report_figures(request: pytest.FixtureRequest, run: E2E) -> None:
    """Print the run's figures after the test summary."""
    class Figures:
        def pytest_terminal_summary(self, terminalreporter: Any) -> None:
            terminalreporter.section("e2e figures")
            for name, value in run.figures.items():
                terminalreporter.write_line(f"{name}: {value}")

    request.config.pluginmanager.register(Figures(), "tasklease-e2e-figures")


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:  # the process ended
        return ""


def _clean(e2e: E2E) -> None:
    """No namespace, release or CRD of an earlier run (pods first: the node may be going away)."""
    for namespace in (NS, RESTRICTED_NS, DIST_NS):
        e2e.kubectl("delete", "pods", "--all", "-n", namespace, "--force", "--grace-period=0", check=False)
    e2e.kubectl("delete", "namespace", NS, RESTRICTED_NS, DIST_NS, "--ignore-not-found", "--timeout=120s",
                check=False)
    e2e.kubectl("delete", "crd", "tasks.tasklease.dev", "--ignore-not-found", "--timeout=60s", check=False)
    for name in (RELEASE, "restricted", DIST_RELEASE):
        e2e.kubectl("delete", "clusterrole,clusterrolebinding,validatingadmissionpolicy,"
                    "validatingadmissionpolicybinding", "-l", f"app.kubernetes.io/instance={name}", check=False)


def _install(e2e: E2E, *extra: str) -> None:
    e2e.kubectl("create", "namespace", NS, check=False)
    e2e.helm("upgrade", "--install", RELEASE, str(CHART), "-n", NS, "--take-ownership", *e2e.values(), *extra)


# -- 1. the operator --------------------------------------------------------------------------------


def test_operator_pod_becomes_ready_with_its_real_probes(e2e: E2E) -> None:
    _install(e2e)
    pods = wait_for(lambda: e2e.ready_pods(NS, OPERATOR_SELECTOR), timeout=180, interval=0.5,
                    message="the operator pod to be Ready")
    container = pods[0]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    if e2e.apiserver_port is not None:
        # The kubelet probes 127.0.0.1, where the operator listens: the same endpoints answer us.
        assert container["readinessProbe"]["httpGet"]["host"] == "127.0.0.1"
        for path in ("/readyz", "/healthz"):
            # A request that failed meanwhile makes the operator unready for a while (by design):
            # wait for 200, and report any other answer seen after the pod was Ready.
            answers: list[str] = []

            def ok(path: str = path, answers: list[str] = answers) -> bool:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{e2e.metrics_port}{path}", timeout=5) as resp:
                        return resp.status == 200
                except urllib.error.HTTPError as exc:
                    answers.append(f"{exc.code} {exc.read().decode().strip()}")
                    return False

            started = time.monotonic()
            try:
                wait_for(ok, timeout=90, interval=0.5, message=f"{path} to answer 200")
            except AssertionError as exc:
                logs = e2e.kubectl("logs", "-n", NS, "-l", OPERATOR_SELECTOR, "--tail=40", check=False)
                raise AssertionError(f"{exc}; it answered {answers[-1:]}; log:\n{logs}") from None
            if answers:
                e2e.figures[f"{path} after Ready"] = f"{answers[0]!r} for {time.monotonic() - started:.1f}s"
        with urllib.request.urlopen(f"http://127.0.0.1:{e2e.metrics_port}/metrics", timeout=5) as resp:
            assert b"tasklease_" in resp.read()
        # Never the eth0 address: the operator's endpoints are on loopback only.
        listening = subprocess.run(["ss", "-Hltn", f"sport = :{e2e.metrics_port}"], capture_output=True,
                                   text=True).stdout
        local_addresses = [line.split()[3] for line in listening.splitlines()]
        assert local_addresses and all(a.startswith("127.0.0.1:") for a in local_addresses), listening
        # The pod's processes are in a cgroup whose packets the iptables rules count.
        groups = [Path(f"/proc/{pid}/cgroup").read_text() for pid in os.listdir("/proc") if pid.isdigit()
                  and f"--http-port={e2e.metrics_port}" in _read(Path(f"/proc/{pid}/cmdline"))]
        assert groups and all("\n0::/kubepods/" in "\n" + g for g in groups), groups


# -- 2. the agents ---------------------------------------------------------------------------------


def test_example_agents_become_ready_with_the_chart_service_account(e2e: E2E) -> None:
    e2e.kubectl("apply", "-n", NS, "-f", "-", input=e2e.agents_manifest())
    pods = wait_for(lambda: len(p := e2e.ready_pods(NS, f"app.kubernetes.io/name={AGENTS}")) == 3 and p,
                    timeout=180, interval=0.5, message="3 agent pods Ready")
    for pod in pods:
        assert pod["spec"]["serviceAccountName"] == "tasklease-agent"
        env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
        assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert env["POD_UID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid"


# -- 3. tasks --------------------------------------------------------------------------------------


def test_tasks_applied_with_kubectl_all_succeed(e2e: E2E) -> None:
    names = [f"photo-{i}" for i in range(6)]
    e2e.apply_tasks(*names)
    wait_for(lambda: all(e2e.phase(n) == "Succeeded" for n in names), timeout=180, interval=1,
             message="every task Succeeded")
    agents = {(p["metadata"]["name"], p["metadata"]["uid"][:8]) for p in e2e.json(
        "pods", "-n", NS, "-l", f"app.kubernetes.io/name={AGENTS}")["items"]}
    holders = set()
    for name in names:
        status = e2e.task(name)["status"]
        assert status["attempt"] == 1
        # The holder is <pod>/<instance>@<pod uid, 8 characters>: POD_NAME and POD_UID from the downward API, and
        # the claim got past the admission policy, which only lets a token bound to that very pod
        # claim in its name.
        holder = status["history"][0]["holder"]
        holders.add((holder.split("/")[0], holder.rpartition("@")[2]))
    assert holders <= agents
    if e2e.local is not None:
        # The audit log names who wrote the Leases: the chart's agent ServiceAccount, with tokens
        # bound to the agent pods.
        writers = set()
        for line in (e2e.local.workdir / "audit.log").read_text().splitlines():
            event = json.loads(line)
            if event.get("objectRef", {}).get("resource") == "leases" and event.get("verb") in ("create", "update") \
                    and event.get("objectRef", {}).get("namespace") == NS:
                user = event["user"]
                writers.add((user["username"], *user.get("extra", {}).get("authentication.kubernetes.io/pod-name",
                                                                           [""])))
        agent_writers = {pod for user, pod in writers if user == f"system:serviceaccount:{NS}:tasklease-agent"}
        assert {pod for pod, _ in holders} <= agent_writers, writers


# A hostile agent's forged completion, sent from inside an agent pod with its own mounted token.
_FORGE = """
import sys
from tasklease.api import errors
from tasklease.kube import LEASES, TASKS, Kube
from tasklease.protocol import record
kube = Kube.connect()
task = kube.get(TASKS, sys.argv[1])
forged = record.LeaseRecord(name=sys.argv[1], namespace=task["metadata"]["namespace"], queue=task["spec"]["queue"],
                            owner_uid=task["metadata"]["uid"], epoch=1, outcome="Succeeded", reason="Completed",
                            result="forged")
try:
    kube.create(LEASES, record.encode(forged))
    print("ACCEPTED")
except errors.TaskleaseError as exc:
    print("REFUSED", exc)
"""


def test_a_forged_completion_from_a_real_agent_pod_is_refused(e2e: E2E) -> None:
    """docs/security.md: an agent cannot close a task it never claimed, whatever it sends."""
    task = yaml.safe_load((ROOT / "examples" / "task.yaml").read_text())
    task["metadata"] = {"name": "never-run"}
    task["spec"]["queue"] = "nobody-works-here"
    e2e.kubectl("apply", "-n", NS, "-f", "-", input=yaml.safe_dump(task))
    pod = e2e.ready_pods(NS, f"app.kubernetes.io/name={AGENTS}")[0]["metadata"]["name"]
    said = e2e.kubectl("exec", "-n", NS, pod, "--", "python3", "-c", _FORGE, "never-run")
    assert said.startswith("REFUSED") and "only to claim it" in said, said
    assert e2e.json("leases", "-n", NS, "--field-selector", "metadata.name=never-run")["items"] == []
    assert e2e.task("never-run").get("status", {}).get("phase", "Pending") == "Pending"


def _claimed(e2e: E2E, name: str) -> str:
    def holder() -> str:
        status = e2e.task(name).get("status", {})
        return str(status.get("holder", "")) if status.get("phase") == "Running" else ""
    return str(wait_for(holder, timeout=120, interval=0.2, message=f"{name} claimed")).split("/")[0]


# -- 4. pod deletion: the fast path -----------------------------------------------------------------


def test_force_deleting_the_holder_pod_requeues_at_once(e2e: E2E) -> None:
    e2e.apply_tasks("force-deleted")
    holder = _claimed(e2e, "force-deleted")
    # Freeze the pod first (a hung or cut-off holder): with a live agent, the kubelet's SIGTERM
    # would have it release the task itself, racing the operator's pod-deletion fast path.
    e2e.kubectl("exec", "-n", NS, holder, "--", "sh", "-c", "kill -STOP -1")
    deleted_at = time.monotonic()
    e2e.kubectl("delete", "pod", holder, "-n", NS, "--grace-period=0", "--force")

    def ended() -> str:
        history = e2e.task("force-deleted").get("status", {}).get("history", [])
        return str(history[0].get("outcome", "")) if history else ""
    outcome = wait_for(ended, timeout=60, interval=0.1, message="the attempt ended")
    assert outcome == "Expired", f"{outcome}: {e2e.task('force-deleted')['status']}\n{e2e.operator_logs()[-3000:]}"
    requeue_s = time.monotonic() - deleted_at
    e2e.figures["pod-deletion requeue"] = f"{requeue_s:.1f}s (lease 30s: the fast path, not the lease running out)"
    # The pod's logs reach `kubectl logs` a moment after the operator wrote them.
    logged = wait_for(lambda: "force-deleted: expired attempt 1" in (logs := e2e.operator_logs()) and logs,
                      timeout=30, message="the expiry logged")
    assert "(pod-gone," in logged.split("force-deleted: expired attempt 1", 1)[1].split("\n", 1)[0]
    wait_for(lambda: e2e.phase("force-deleted") == "Succeeded", timeout=120, interval=0.5,
             message="another pod finished it")
    final = e2e.task("force-deleted")["status"]
    assert final["attempt"] == 2 and not final["holder"].startswith(holder)


# -- 5. graceful deletion: SIGTERM ----------------------------------------------------------------


def test_graceful_pod_deletion_releases_the_task_and_exits_within_grace(e2e: E2E) -> None:
    wait_for(lambda: len(e2e.ready_pods(NS, f"app.kubernetes.io/name={AGENTS}")) == 3, timeout=120, interval=0.5,
             message="the Deployment back to 3 Ready agents")
    e2e.apply_tasks("gracefully-stopped")
    holder = _claimed(e2e, "gracefully-stopped")
    last: dict[str, Any] = {}

    def gone() -> bool:
        found = e2e.json("pods", "-n", NS, "--field-selector", f"metadata.name={holder}")["items"]
        last.update(found[0] if found else {})
        return not found

    with _following_log(e2e, holder) as logged:
        started, deleted = time.monotonic(), time.time()
        e2e.kubectl("delete", "pod", holder, "-n", NS, "--wait=false")

        def released() -> bool:
            history = e2e.task("gracefully-stopped").get("status", {}).get("history", [])
            return bool(history) and history[0].get("outcome") == "Released"
        wait_for(released, timeout=30, interval=0.1, message="the task released by SIGTERM")
        try:
            wait_for(gone, timeout=60, interval=0.2, message="the pod gone")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {_termination(last, deleted)}; its log:\n{logged()}") from None
        gone_s = time.monotonic() - started
        exited_s = _exited_after_delete_s(last, deleted)
        # The container exited on its own: one killed at the end of its grace period takes 30s.
        # (The kubelet removes the pod a moment later; that moment is not the agent's.)
        assert gone_s < 25 or (exited_s is not None and exited_s < 25), (
            f"the pod took {gone_s:.1f}s to go: {_termination(last, deleted)}; its log:\n{logged()}")
    exited = f"; its container exited {exited_s:.0f}s after the delete" if exited_s is not None else ""
    e2e.figures["graceful deletion, pod gone"] = f"{gone_s:.1f}s of a 30s grace period{exited}"
    wait_for(lambda: e2e.phase("gracefully-stopped") == "Succeeded", timeout=120, interval=0.5,
             message="the released task finished by another pod")


@contextlib.contextmanager
def _following_log(e2e: E2E, pod: str) -> Iterator[Callable[[], str]]:
    """`kubectl logs -f` of `pod` while the block runs: what its agent said up to its end."""
    with tempfile.TemporaryFile("w+") as out:
        follower = subprocess.Popen([*e2e.prefix, str(binaries.ensure_kubectl()), f"--kubeconfig={e2e.kubeconfig}",
                                     "logs", "-f", "--timestamps", "-n", NS, pod],
                                    stdout=out, stderr=subprocess.STDOUT, text=True)

        def logged() -> str:
            out.flush()
            out.seek(0)
            return out.read()[-4000:]
        try:
            yield logged
        finally:
            follower.kill()
            follower.wait()


def _container_states(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [c.get("state", {}) for c in pod.get("status", {}).get("containerStatuses", [])]


def _exited_after_delete_s(pod: dict[str, Any], deleted: float) -> float | None:
    """Seconds from `deleted` (this machine's clock, which the node's is) to the exit of the
    pod's container, to within the whole second the kubelet reports (so at least 0); None when
    the last look did not see it terminated."""
    finished = [datetime.fromisoformat(s["terminated"]["finishedAt"]).timestamp()
                for s in _container_states(pod) if "terminated" in s]
    return max(max(finished) - deleted, 0.0) if finished else None


def _termination(pod: dict[str, Any], deleted: float) -> str:
    if not pod:
        return "the pod not seen since the delete"
    exited = _exited_after_delete_s(pod, deleted)
    seen = f"exited {exited:.0f}s after the delete" if exited is not None else "not seen exited"
    return f"its container {seen}; states {_container_states(pod)}; phase {pod.get('status', {}).get('phase')}"


# -- 5b. pod-bound leases: a shell agent with no renew loop (docs/pod-bound.md) -----------------------

POD_BOUND_QUEUE = "pod-bound"
# Claims once per Pod (the emptyDir outlives a container restart), then does what MODE says:
# `sleep` sleeps 20s (four lease durations) and completes; `wait` waits for /tmp/die and exits 1
# (its container restarts); `hold` holds the task for good. No `tasklease renew` anywhere.
_POD_BOUND_SCRIPT = """
if [ -e /tmp/claimed ]; then exec sleep 3600; fi
touch /tmp/claimed
eval "$(tasklease claim --queue pod-bound --pod-bound --wait 60 --format env)" || exit 2
case "$MODE" in
  sleep) sleep 20; tasklease complete --result "slept 20s unrenewed" ;;
  wait) while [ ! -e /tmp/die ]; do sleep 0.2; done; exit 1 ;;
esac
exec sleep 3600
"""


def _pod_bound_ready(e2e: E2E) -> Kube:
    """The release installed (when this scenario runs alone) and a client of the node's API server."""
    if not e2e.ready_pods(NS, OPERATOR_SELECTOR):
        _install(e2e)
        wait_for(lambda: e2e.ready_pods(NS, OPERATOR_SELECTOR), timeout=180, interval=0.5,
                 message="the operator pod to be Ready")
    return Kube.connect(kubeconfig=str(e2e.kubeconfig), namespace=NS)


def _pod_bound_shell(e2e: E2E, kube: Kube, name: str, mode: str, *, lease_s: int) -> str:
    """A Task of the pod-bound queue and a shell agent Pod (the example's pod, its container a
    script) that claims it --pod-bound; returns the Pod's uid once it holds the task."""
    e2e.kubectl("apply", "-n", NS, "-f", "-", input=yaml.safe_dump({
        "apiVersion": "tasklease.dev/v1alpha1", "kind": "Task", "metadata": {"name": name},
        "spec": {"queue": POD_BOUND_QUEUE, "leaseDurationSeconds": lease_s, "payload": {"mode": mode}}}))
    template = yaml.safe_load(e2e.agents_manifest())["spec"]["template"]
    spec = template["spec"]
    container = spec["containers"][0]
    container.pop("args")
    container.update(name="work", command=["sh", "-c", _POD_BOUND_SCRIPT])
    container["env"].append({"name": "MODE", "value": mode})
    # Not the Deployment's: another name label, or its ReplicaSet would adopt the Pod.
    labels = {**template["metadata"]["labels"], "app.kubernetes.io/name": "pod-bound-shell"}
    e2e.kubectl("apply", "-n", NS, "-f", "-", input=yaml.safe_dump({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels}, "spec": spec}))

    def bound() -> record.LeaseRecord | None:
        lease = kube.get_or_none(LEASES, name, namespace=NS)
        rec = record.decode(lease) if lease else None
        return rec if rec is not None and rec.state == record.HELD and rec.pod_bound else None
    rec = wait_for(bound, timeout=180, interval=0.2, message=f"{name} claimed --pod-bound")
    uid = str(e2e.json("pod", name, "-n", NS)["metadata"]["uid"])
    assert rec.pod_bound == uid and rec.holder_pod == name, rec
    return uid


def _first_attempt(e2e: E2E, name: str) -> dict[str, Any]:
    history = e2e.task(name).get("status", {}).get("history", [])
    return dict(history[0]) if history else {}


def _attempt_over(kube: Kube, name: str, epoch: int) -> float:
    """Poll the Lease until attempt `epoch` is no longer held; the monotonic time it was seen so."""
    def over() -> bool:
        rec = record.decode(kube.get(LEASES, name, namespace=NS))
        return rec.state != record.HELD or rec.epoch != epoch
    wait_for(over, timeout=60, interval=0.02, message=f"attempt {epoch} of {name} over")
    return time.monotonic()


def test_pod_bound_claim_survives_a_long_sleep_without_renewals(e2e: E2E) -> None:
    kube = _pod_bound_ready(e2e)
    _pod_bound_shell(e2e, kube, "pod-bound-sleeper", "sleep", lease_s=5)
    wait_for(lambda: e2e.phase("pod-bound-sleeper") == "Succeeded", timeout=120, interval=0.5,
             message=f"the sleeper's task Succeeded\n{e2e.operator_logs()[-3000:]}")
    status = e2e.task("pod-bound-sleeper")["status"]
    assert status["attempt"] == 1 and [a["outcome"] for a in status["history"]] == ["Succeeded"], status
    assert status["result"] == "slept 20s unrenewed"
    reasons = [e["reason"] for e in e2e.json("events", "-n", NS, "--field-selector",
                                              "involvedObject.name=pod-bound-sleeper")["items"]]
    assert "PodBound" in reasons, reasons
    e2e.kubectl("delete", "pod", "pod-bound-sleeper", "-n", NS, "--grace-period=0", "--force")


# Both requeues below must come well before the 30 s lease could lapse: a third of it is the
# bound, so a loaded machine does not fail them; `make e2e` prints the time each took.
POD_BOUND_LEASE_S = 30


def test_pod_bound_task_is_requeued_on_its_pods_deletion_without_waiting_for_the_lease(e2e: E2E) -> None:
    kube = _pod_bound_ready(e2e)
    _pod_bound_shell(e2e, kube, "pod-bound-deleted", "hold", lease_s=POD_BOUND_LEASE_S)
    e2e.kubectl("delete", "pod", "pod-bound-deleted", "-n", NS, "--grace-period=0", "--force")
    deleted_at = time.monotonic()
    took = _attempt_over(kube, "pod-bound-deleted", 1) - deleted_at
    e2e.figures["pod-bound, pod deleted → requeued"] = f"{took:.2f}s (lease {POD_BOUND_LEASE_S}s)"
    assert took < POD_BOUND_LEASE_S / 3, f"{took:.2f}s from the pod's deletion to the requeue"
    wait_for(lambda: _first_attempt(e2e, "pod-bound-deleted").get("outcome") == "Expired", timeout=30,
             interval=0.2, message="the expiry projected into the Task's status")


def test_pod_bound_task_is_requeued_on_a_container_restart_without_waiting_for_the_lease(e2e: E2E) -> None:
    kube = _pod_bound_ready(e2e)
    _pod_bound_shell(e2e, kube, "pod-bound-restarted", "wait", lease_s=POD_BOUND_LEASE_S)
    try:
        e2e.kubectl("exec", "-n", NS, "pod-bound-restarted", "--", "touch", "/tmp/die")

        def stopped() -> bool:
            pod = kube.get(PODS, "pod-bound-restarted", namespace=NS)
            statuses = pod.get("status", {}).get("containerStatuses", [])
            return any(c.get("restartCount", 0) > 0 or "running" not in (c.get("state") or {}) for c in statuses)
        wait_for(stopped, timeout=60, interval=0.02, message="the container's exit in the Pod's status")
        seen_at = time.monotonic()
        took = max(_attempt_over(kube, "pod-bound-restarted", 1) - seen_at, 0.0)
        e2e.figures["pod-bound, container restarted → requeued"] = f"{took:.2f}s after the API server showed it"
        assert took < POD_BOUND_LEASE_S / 3, f"{took:.2f}s from the container's restart to the requeue"
        first = wait_for(lambda: (a := _first_attempt(e2e, "pod-bound-restarted")).get("outcome") and a, timeout=30,
                         interval=0.2, message="the expiry projected into the Task's status")
        assert first["outcome"] == "Expired" and "container work" in first["message"], first
        wait_for(lambda: e2e.json("pod", "pod-bound-restarted", "-n", NS)["status"]["containerStatuses"][0]
                 .get("restartCount", 0) >= 1, timeout=60, interval=0.5, message="the container restarted")
    finally:  # a failure here must not leave its Pod to fail the uninstall test as well
        e2e.kubectl("delete", "pod", "pod-bound-restarted", "-n", NS, "--grace-period=0", "--force",
                    "--ignore-not-found")


# -- 6. the operator pod dies ---------------------------------------------------------------------


def test_operator_pod_death_loses_nothing_and_completes_nothing_twice(e2e: E2E) -> None:
    old = e2e.ready_pods(NS, OPERATOR_SELECTOR)[0]["metadata"]["name"]
    names = [f"during-restart-{i}" for i in range(4)]
    e2e.apply_tasks(*names)
    e2e.kubectl("delete", "pod", old, "-n", NS, "--wait=false")
    wait_for(lambda: [p for p in e2e.ready_pods(NS, OPERATOR_SELECTOR) if p["metadata"]["name"] != old],
             timeout=180, interval=0.5, message="a replacement operator pod Ready")
    wait_for(lambda: all(e2e.phase(n) == "Succeeded" for n in names), timeout=180, interval=1,
             message="every task Succeeded across the operator restart")
    for name in names:
        history = e2e.task(name)["status"]["history"]
        assert [a["outcome"] for a in history] == ["Succeeded"], f"{name}: {history}"


# -- 6b. scale-down drains --------------------------------------------------------------------------


def _watch_exits(e2e: E2E, selector: str) -> tuple[subprocess.Popen[str], dict[str, int]]:
    """Follow the pods of `selector` (a watch: a pod's last status, its containers' exit codes,
    is written before the pod goes), into {pod: exit code}."""
    watcher = subprocess.Popen([str(binaries.ensure_kubectl()), f"--kubeconfig={e2e.kubeconfig}", "get", "pods",
                                "-n", NS, "-l", selector, "--watch", "--output-watch-events", "-o", "json"],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    exits: dict[str, int] = {}

    def follow() -> None:
        assert watcher.stdout is not None
        decoder, buffer = json.JSONDecoder(), ""
        for line in watcher.stdout:
            buffer += line
            try:
                event, end = decoder.raw_decode(buffer.lstrip())
            except ValueError:
                continue
            buffer = buffer.lstrip()[end:]
            pod = event["object"]
            for status in pod.get("status", {}).get("containerStatuses", []):
                if "terminated" in status.get("state", {}):
                    exits[pod["metadata"]["name"]] = status["state"]["terminated"]["exitCode"]

    threading.Thread(target=follow, daemon=True).start()
    return watcher, exits


def test_scale_down_drains_the_agents_and_scale_up_resumes(e2e: E2E) -> None:
    """Issue 34 item 4: the example agents (`tasklease run --drain`) scaled to zero with tasks
    in flight claim no more, finish what they run within the grace period and exit 0, and no
    task is expired or requeued; scaled back up, they take the rest."""
    selector = f"app.kubernetes.io/name={AGENTS}"
    if not e2e.ready_pods(NS, OPERATOR_SELECTOR):  # run alone (`-k drain`)
        _install(e2e)
        wait_for(lambda: e2e.ready_pods(NS, OPERATOR_SELECTOR), timeout=180, interval=0.5,
                 message="the operator pod to be Ready")
    e2e.kubectl("apply", "-n", NS, "-f", "-", input=e2e.agents_manifest(drain=True))
    e2e.kubectl("rollout", "status", f"deployment/{AGENTS}", "-n", NS, "--timeout=180s")
    pods = wait_for(lambda: len(p := e2e.ready_pods(NS, selector)) == 3 and p, timeout=180, interval=0.5,
                    message="3 draining agent pods Ready")
    assert all("--drain" in p["spec"]["containers"][0]["args"] for p in pods)
    names = [f"drained-{i}" for i in range(9)]  # 3 agents, tasks of 5 s: some still wait at the scale-down
    e2e.apply_tasks(*names)

    def running() -> list[str]:
        return [t["metadata"]["name"] for t in e2e.json("tasks", "-n", NS)["items"]
                if t["metadata"]["name"] in names and t.get("status", {}).get("phase") == "Running"]
    wait_for(lambda: len(running()) == 3, timeout=120, interval=0.2, message="3 tasks in flight, one per agent")
    watcher, exits = _watch_exits(e2e, selector)
    try:
        started = time.monotonic()
        e2e.kubectl("scale", f"deployment/{AGENTS}", "-n", NS, "--replicas=0")
        in_flight = running()
        assert in_flight, "no task in flight at the scale-down"
        wait_for(lambda: not e2e.json("pods", "-n", NS, "-l", selector)["items"], timeout=60, interval=0.2,
                 message="every agent pod gone")
        gone_s = time.monotonic() - started
        # The watch may also show a pod of the rollout before, still going when it started.
        drained = {p["metadata"]["name"] for p in pods}
        try:
            wait_for(lambda: drained <= exits.keys(), timeout=10, interval=0.1,
                     message="the exit codes of the 3 agents")
        except AssertionError as exc:  # what the watch saw, and whether it still runs (None)
            raise AssertionError(f"{exc}: seen {exits}; kubectl's watch ended with {watcher.poll()}") from None
    finally:
        watcher.terminate()
        watcher.wait(10)
    assert {name: exits[name] for name in drained} == dict.fromkeys(drained, 0), exits
    assert gone_s < 25, f"the agents took {gone_s:.1f}s to go: they did not exit within their grace period"
    e2e.figures["scale-down drain, agents gone"] = (f"{gone_s:.1f}s of a 30s grace period "
                                                    f"({len(in_flight)} tasks of 5s in flight)")
    wait_for(lambda: not running(), timeout=30, interval=0.2, message="the drained tasks projected finished")
    waiting = []
    for name in names:  # each finished once by the agent that had it, or never claimed: nothing expired or left
        status = e2e.task(name).get("status", {})
        outcomes = [a["outcome"] for a in status.get("history", [])]
        if status.get("phase", "Pending") == "Pending" and not outcomes:
            waiting.append(name)
        else:
            assert status["phase"] == "Succeeded" and outcomes == ["Succeeded"], f"{name}: {status}"
    assert waiting and not set(waiting) & set(in_flight), (waiting, in_flight)

    e2e.kubectl("scale", f"deployment/{AGENTS}", "-n", NS, "--replicas=3")
    wait_for(lambda: len(e2e.ready_pods(NS, selector)) == 3, timeout=180, interval=0.5,
             message="3 agents back")
    wait_for(lambda: all(e2e.phase(n) == "Succeeded" for n in waiting), timeout=180, interval=1,
             message="the waiting tasks taken once the agents came back")
    for name in names:
        history = e2e.task(name)["status"]["history"]
        assert [a["outcome"] for a in history] == ["Succeeded"], f"{name}: {history}"
    logs = e2e.operator_logs()
    assert not [n for n in names if f"{n}: expired attempt" in logs], logs[-3000:]


# -- 7. a namespace enforcing Pod Security `restricted` ----------------------------------------------


def test_the_chart_and_example_are_admitted_under_restricted(e2e: E2E) -> None:
    e2e.kubectl("create", "namespace", RESTRICTED_NS)
    e2e.kubectl("label", "namespace", RESTRICTED_NS, "pod-security.kubernetes.io/enforce=restricted")
    # hostNetwork is never `restricted`: this install uses the chart's normal pod-network values.
    e2e.helm("install", "restricted", str(CHART), "-n", RESTRICTED_NS, "--set", "crds.enabled=false",
             "--set", "operator.replicas=1", *e2e.values(host_network=False))
    e2e.kubectl("apply", "-n", RESTRICTED_NS, "-f", "-", input=e2e.agents_manifest(host_network=False))

    def admitted(selector: str, count: int) -> bool:
        return len(e2e.json("pods", "-n", RESTRICTED_NS, "-l", selector)["items"]) == count
    # Admitted: the ReplicaSets created every pod, past Pod Security `restricted`.
    wait_for(lambda: admitted("app.kubernetes.io/instance=restricted", 1), timeout=120, interval=1,
             message="the operator pod admitted")
    wait_for(lambda: admitted(f"app.kubernetes.io/name={AGENTS}", 3), timeout=120, interval=1,
             message="the agent pods admitted")
    events = e2e.kubectl("get", "events", "-n", RESTRICTED_NS, "--field-selector", "reason=FailedCreate")
    assert "violates PodSecurity" not in events
    if e2e.apiserver_port is None:
        # On a pod network they run for real. (The local node runs hostNetwork pods only: its
        # loopback-only CNI gives a pod network namespace no address, so these cannot start there.)
        wait_for(lambda: e2e.ready_pods(RESTRICTED_NS, "app.kubernetes.io/instance=restricted"), timeout=180,
                 interval=1, message="the operator Ready under restricted")
        wait_for(lambda: len(e2e.ready_pods(RESTRICTED_NS, f"app.kubernetes.io/name={AGENTS}")) == 3,
                 timeout=180, interval=1, message="the agents Ready under restricted")
    # Proof the label bites: a hostNetwork pod is refused there.
    refused = e2e.run_kubectl("apply", "-n", RESTRICTED_NS, "-f", "-",
                              input=e2e.agents_manifest(host_network=True).replace(AGENTS, "hostnet-agents"))
    if e2e.apiserver_port is not None:
        wait_for(lambda: "violates PodSecurity" in e2e.kubectl(
            "get", "events", "-n", RESTRICTED_NS, "--field-selector", "reason=FailedCreate"),
            timeout=60, interval=1, message="the hostNetwork pods refused by Pod Security")
    assert refused.returncode == 0  # Deployments are admitted; their pods are not
    e2e.kubectl("delete", "deployment", "--all", "-n", RESTRICTED_NS)
    e2e.helm("uninstall", "restricted", "-n", RESTRICTED_NS)


# -- 8. upgrade with a changed CRD --------------------------------------------------------------------


def test_helm_upgrade_applies_a_changed_crd(e2e: E2E, tmp_path: Path) -> None:
    changed = tmp_path / "tasklease"
    subprocess.run(["cp", "-r", str(CHART), str(changed)], check=True)
    crd_file = changed / "files" / "tasks.tasklease.dev.yaml"
    crd = yaml.safe_load(crd_file.read_text())
    crd["spec"]["versions"][0]["additionalPrinterColumns"].append(
        {"name": "Upgraded", "type": "string", "jsonPath": ".spec.queue", "priority": 1})
    crd_file.write_text(yaml.safe_dump(crd))
    e2e.helm("upgrade", RELEASE, str(changed), "-n", NS, *e2e.values())
    served = e2e.json("crd", "tasks.tasklease.dev")
    assert "Upgraded" in [c["name"] for c in served["spec"]["versions"][0]["additionalPrinterColumns"]]
    assert e2e.phase("photo-0") == "Succeeded"  # the tasks are untouched
    e2e.helm("upgrade", RELEASE, str(CHART), "-n", NS, *e2e.values())
    served = e2e.json("crd", "tasks.tasklease.dev")
    assert "Upgraded" not in [c["name"] for c in served["spec"]["versions"][0]["additionalPrinterColumns"]]


# -- 9. uninstall ---------------------------------------------------------------------------------


def test_uninstall_keeps_the_crd_and_tasks_and_nothing_else(e2e: E2E) -> None:
    # The agents first: they use the chart's ServiceAccount, which the uninstall deletes.
    e2e.kubectl("delete", "deployment", AGENTS, "-n", NS, "--wait=true", "--timeout=60s")
    tasks_before = {t["metadata"]["name"] for t in e2e.json("tasks", "-n", NS)["items"]}
    e2e.helm("uninstall", RELEASE, "-n", NS, "--wait")
    crd = e2e.json("crd", "tasks.tasklease.dev")
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert {t["metadata"]["name"] for t in e2e.json("tasks", "-n", NS)["items"]} == tasks_before
    kinds = ("deployments,replicasets,pods,services,serviceaccounts,roles,rolebindings,poddisruptionbudgets,"
             "configmaps,secrets")
    left = e2e.json(kinds, "-A", "-l", f"app.kubernetes.io/instance={RELEASE}")["items"]
    left += e2e.json("clusterroles,clusterrolebindings,validatingadmissionpolicies,"
                     "validatingadmissionpolicybindings", "-l", f"app.kubernetes.io/instance={RELEASE}")["items"]
    assert [f"{o['kind']}/{o['metadata']['name']}" for o in left
            if not o["metadata"].get("deletionTimestamp")] == []  # a pod still terminating counts as gone
    wait_for(lambda: not e2e.json("pods", "-n", NS)["items"], timeout=60, interval=0.5, message="no pod left")


# -- 10. a release as users get it: dist/ -------------------------------------------------------------


@pytest.mark.skipif(bool(EXTERNAL), reason="imports the image into the local node's containerd")
def test_the_release_from_dist_installs_and_passes_helm_test(e2e: E2E, tmp_path: Path) -> None:
    """Issue 35: the chart packaged by `make dist` installs with the image `make dist` built
    (its OCI archive, imported into the node's containerd: no registry), and its `helm test`
    hook (the operator Ready, a Task round-trip) passes in the cluster."""
    assert e2e.node is not None
    out = tmp_path / "dist"
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "tasklease_dev.dist", "--out", str(out)], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL, timeout=1800)
    e2e.figures["make dist"] = f"{time.monotonic() - t0:.1f}s"
    release = dist.version()
    (chart,) = out.glob(f"tasklease-{release}.tgz")
    (image,) = out.glob(f"tasklease-image-{release}.oci.tar")
    sums = dict(reversed(line.split("  ")) for line in (out / "SHA256SUMS").read_text().splitlines())
    assert sums[chart.name] == dist._sha256(chart) and sums[image.name] == dist._sha256(image)
    e2e.node.import_image(image)

    e2e.kubectl("create", "namespace", DIST_NS, check=False)
    # The chart's default image (tasklease:<appVersion>), never pulled; CRD taken over from an
    # earlier release of this run, which keeps it on uninstall.
    e2e.helm("install", DIST_RELEASE, str(chart), "-n", DIST_NS, "--take-ownership", "--wait", "--timeout=300s",
             *e2e.values(metrics_port=free_port(), dev_image=False))
    operator = wait_for(lambda: e2e.ready_pods(DIST_NS, f"app.kubernetes.io/instance={DIST_RELEASE},"
                                                        "app.kubernetes.io/component=operator"),
                        timeout=180, interval=0.5, message="the release's operator Ready")
    assert operator[0]["spec"]["containers"][0]["image"] == f"tasklease:{release}"
    t0 = time.monotonic()
    tested = e2e.helm("test", DIST_RELEASE, "-n", DIST_NS, "--logs", "--timeout=300s")
    e2e.figures["helm test"] = f"{time.monotonic() - t0:.1f}s"
    assert "Phase:          Succeeded" in tested or "Phase: Succeeded" in " ".join(tested.split()), tested
    assert "round-tripped" in tested and "is ready" in tested, tested
    e2e.helm("uninstall", DIST_RELEASE, "-n", DIST_NS, "--wait")
    e2e.kubectl("delete", "namespace", DIST_NS, "--timeout=120s")


# -- loopback only, and nothing left -----------------------------------------------------------------


@pytest.mark.skipif(bool(EXTERNAL), reason="the local node's network fence")
def test_no_packet_from_the_node_left_loopback(e2e: E2E) -> None:
    counters = node.iptables_counters()
    assert counters["tasklease-node-loopback"] > 0, "the rule must see the node's own traffic"
    assert counters["tasklease-node-offbox"] == 0, f"packets from the node went off loopback: {counters}"
    assert counters["tasklease-service-range"] == 0, f"something tried the Service range: {counters}"
    # The fence holds: a connection to the `kubernetes` ClusterIP is refused here, never sent.
    with pytest.raises(OSError), socket.create_connection(("10.0.0.1", 443), timeout=5):
        pass
    assert node.iptables_counters()["tasklease-service-range"] >= 1
    e2e.figures["iptables"] = f"{counters['tasklease-node-loopback']} node packets on loopback, 0 elsewhere"


@pytest.mark.skipif(bool(EXTERNAL), reason="the local node")
def test_node_down_leaves_nothing(e2e: E2E) -> None:
    assert e2e.node is not None
    state = e2e.node.running()
    assert state is not None
    # Pods ran in the node's cgroup, which the iptables rules match.
    assert node.node_cgroups() and node.node_mounts([e2e.node.workdir])
    for _ in range(2):  # idempotent
        subprocess.run([sys.executable, "-m", "tasklease_dev", "node-down"], cwd=ROOT, check=True)
    from tasklease_dev.cluster import process_alive
    assert not [name for name, pid in state.pids.items() if process_alive(pid)]
    assert not node.node_mounts([e2e.node.workdir, *node.HOST_LEAKS])
    assert not node.node_cgroups()
    assert _node_snapshot() == e2e.before
    assert not e2e.node.workdir.exists()

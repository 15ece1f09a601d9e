"""A real, local Kubernetes control plane: etcd, kube-apiserver and kube-controller-manager.

What envtest does, plus the controller-manager (for the garbage collector, namespace
deletion and service-account tokens) and an audit log the tests read. Everything
listens on 127.0.0.1; all state lives in one work directory, so several clusters
(a developer's `make cluster` and the test suite's) can run side by side.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from tasklease_dev import binaries

ADMIN_USER = "tasklease-admin"
_STATE_FILE = "cluster.json"
_READY_TIMEOUT_S = 90.0
# The audit log rotates at this size (MB), keeping _AUDIT_BACKUPS older files beside it:
# `audit_files()` reads them all, oldest first.
_AUDIT_MAX_MB = 200
_AUDIT_BACKUPS = 20
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager")

# Metadata for everything (enough to count who made which request) and the whole
# object for Leases, so tests can replay every write of the claim protocol.
_AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "RequestResponse", "resources": [{"group": "coordination.k8s.io", "resources": ["leases"]}],
         "verbs": ["create", "update", "patch", "delete"]},
        {"level": "Metadata"},
    ],
}



def stop_on_sigterm() -> None:
    """For a command that starts a control plane of its own and stops it on the way out (a
    `finally`): SIGTERM (a CI timeout, `kill`) then unwinds the main thread as Ctrl-C does, so
    the control plane and the processes of the run are stopped, not left behind. For a
    command's main only: it replaces the process's handler."""
    def unwind(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, unwind)


@dataclass
class ClusterState:
    workdir: str
    etcd_port: int
    apiserver_port: int
    pids: dict[str, int]
    kubeconfig: str
    audit_log: str
    version: str
    # Started for `make node`: the apiserver reaches kubelets, the controller-manager runs
    # what pods need. Off for the test suite, whose control plane stays as it was.
    node: bool = False

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.apiserver_port}"


class LocalCluster:
    """Starts, finds and stops the control plane kept in ``workdir``."""

    def __init__(self, workdir: Path, kubeconfig: Path | None = None) -> None:
        self.workdir = workdir.resolve()
        self.kubeconfig = (kubeconfig or self.workdir / "kubeconfig").resolve()

    # -- public -----------------------------------------------------------------

    def running(self) -> ClusterState | None:
        """The state of a healthy cluster started from this workdir, or None."""
        path = self.workdir / _STATE_FILE
        if not path.exists():
            return None
        state = ClusterState(**json.loads(path.read_text()))
        if not all(process_alive(pid) for pid in state.pids.values()):
            return None
        return state if self._ready(state) else None

    def up(self, *, node: bool = False) -> ClusterState:
        state = self.running()
        if state is not None and (state.node or not node):
            return state
        if state is not None:
            _log("restarting the control plane with what a node needs (its data is not kept)")
        self.down()
        bins = binaries.ensure_kubernetes()
        started = time.monotonic()
        self.workdir.mkdir(parents=True, exist_ok=True)
        pki = self._make_pki()
        etcd_port, apiserver_port = free_port(), free_port()
        state = ClusterState(
            workdir=str(self.workdir), etcd_port=etcd_port, apiserver_port=apiserver_port,
            pids={}, kubeconfig=str(self.kubeconfig), audit_log=str(self.workdir / "audit.log"),
            version=binaries.KUBERNETES_VERSION, node=node,
        )
        try:
            state.pids["etcd"] = self._start_etcd(bins, etcd_port)
            self._write_state(state)
            state.pids["kube-apiserver"] = self._start_apiserver(bins, state, pki)
            self._write_state(state)
            self._wait_ready(state)
            self._write_kubeconfigs(state, pki)
            state.pids["kube-controller-manager"] = self._start_controller_manager(bins, pki, node=node)
            self._write_state(state)
        except BaseException:
            self.down()
            raise
        _log(f"control plane {state.version} ready at {state.server} in {time.monotonic() - started:.1f}s")
        return state

    def down(self) -> None:
        """Stop every process this workdir's cluster started and remove its data. A pid in
        the state file is only signalled while it is still one of ours (its command line
        names this workdir): a pid reused by another process is left alone."""
        path = self.workdir / _STATE_FILE
        if path.exists():
            pids = json.loads(path.read_text()).get("pids", {})
            for name in reversed(COMPONENTS):
                pid = pids.get(name)
                if pid and self.owns(pid):
                    terminate(pid)
            path.unlink()
        for rotated in audit_files(self.workdir / "audit.log"):
            rotated.unlink()
        for sub in ("etcd-data", "pki", "logs"):
            target = self.workdir / sub
            if target.is_dir():
                _rmtree(target)
            elif target.exists():
                target.unlink()
        if self.kubeconfig.exists():
            self.kubeconfig.unlink()

    def owns(self, pid: int) -> bool:
        """True when `pid` is a process this workdir's cluster started (and still runs)."""
        return started_in(pid, self.workdir)

    def restart(self, component: str, *, sig: int = signal.SIGKILL) -> ClusterState:
        """Kill one component (SIGKILL by default, as a crash would) and start it again with
        the same ports and data; returns once the API server answers again."""
        if component not in COMPONENTS:
            raise ValueError(f"unknown component {component!r}: one of {', '.join(COMPONENTS)}")
        state = self.running_or_partial()
        pid = state.pids[component]
        if self.owns(pid):
            os.kill(pid, sig)
            deadline = time.monotonic() + 30
            while process_alive(pid) and time.monotonic() < deadline:
                _reap(pid)
                time.sleep(0.05)
        _reap(pid)
        # A killed Go process shows as a zombie while its other threads still hold its
        # sockets: wait until its port can be bound again.
        port = {"etcd": state.etcd_port, "kube-apiserver": state.apiserver_port}.get(component)
        if port is not None:
            _wait_port_free(port)
        bins = binaries.ensure_kubernetes()
        pki = self._pki_paths()
        if component == "etcd":
            state.pids[component] = self._start_etcd(bins, state.etcd_port)
        elif component == "kube-apiserver":
            state.pids[component] = self._start_apiserver(bins, state, pki)
        else:
            state.pids[component] = self._start_controller_manager(bins, pki, node=state.node)
        self._write_state(state)
        self._wait_ready(state)
        return state

    def running_or_partial(self) -> ClusterState:
        """The state file as written by `up`, whether or not every component runs now."""
        path = self.workdir / _STATE_FILE
        if not path.exists():
            raise RuntimeError(f"no cluster in {self.workdir}: run `up` first")
        return ClusterState(**json.loads(path.read_text()))

    def audit_files(self) -> list[Path]:
        """The audit log and its rotated backups, oldest first."""
        log = self.workdir / "audit.log"
        return audit_files(log)

    # -- processes ----------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> int:
        logs = self.workdir / "logs"
        logs.mkdir(exist_ok=True)
        with open(logs / f"{name}.log", "ab") as out:
            # A new session: the control plane outlives `make cluster`, and Ctrl-C
            # in the terminal that started it does not reach it.
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        return proc.pid

    def _start_etcd(self, bins: binaries.Binaries, port: int) -> int:
        url = f"http://127.0.0.1:{port}"
        return self._spawn("etcd", [
            str(bins.etcd),
            "--name=tasklease",
            f"--data-dir={self.workdir / 'etcd-data'}",
            f"--listen-client-urls={url}",
            f"--advertise-client-urls={url}",
            f"--listen-peer-urls=http://127.0.0.1:{free_port()}",
            "--unsafe-no-fsync",
            "--log-level=warn",
        ])

    def _start_apiserver(self, bins: binaries.Binaries, state: ClusterState, pki: dict[str, Path]) -> int:
        policy = self.workdir / "pki" / "audit-policy.yaml"
        policy.write_text(yaml.safe_dump(_AUDIT_POLICY))
        return self._spawn("kube-apiserver", [
            str(bins.kube_apiserver),
            f"--etcd-servers=http://127.0.0.1:{state.etcd_port}",
            f"--cert-dir={self.workdir / 'pki'}",
            f"--tls-cert-file={pki['serving_crt']}",
            f"--tls-private-key-file={pki['serving_key']}",
            f"--client-ca-file={pki['ca_crt']}",
            f"--secure-port={state.apiserver_port}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            # An Endpoints may not hold a loopback address: the default reconciler would fail to
            # write the `kubernetes` Service's every 10 s. Nothing reads them here: pods on the
            # node are handed 127.0.0.1 (the chart's `apiServer`), and kind has its own API server.
            "--endpoint-reconciler-type=none",
            "--service-cluster-ip-range=10.0.0.0/24",
            "--authorization-mode=RBAC",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki['sa_pub']}",
            f"--service-account-signing-key-file={pki['sa_key']}",
            f"--audit-policy-file={policy}",
            f"--audit-log-path={state.audit_log}",
            "--audit-log-format=json",
            "--audit-log-mode=blocking",
            f"--audit-log-maxsize={_AUDIT_MAX_MB}",
            f"--audit-log-maxbackup={_AUDIT_BACKUPS}",
            "--allow-privileged=true",
            # PodTemplates, which tasklease never uses, are watched straight from etcd, not from the
            # watch cache: after a compaction (`compact_etcd`) an old resourceVersion is really gone,
            # and the test suite sees a watch answer 410 Gone.
            "--watch-cache-sizes=podtemplates#0",
            *([
                # kubectl logs/exec: the kubelet authenticates the apiserver by client cert,
                # and listens on 127.0.0.1 only, which the node's Hostname resolves to.
                f"--kubelet-client-certificate={pki['admin_crt']}",
                f"--kubelet-client-key={pki['admin_key']}",
                "--kubelet-preferred-address-types=Hostname,InternalIP",
            ] if state.node else []),
        ])

    def _start_controller_manager(self, bins: binaries.Binaries, pki: dict[str, Path], *, node: bool) -> int:
        controllers = ["garbagecollector", "namespace", "serviceaccount", "serviceaccount-token"]
        if node:
            # Deployments make pods; every pod mounts kube-root-ca.crt; nodelifecycle lifts the
            # not-ready taint a kubelet registers with; podgc removes pods of a deleted node.
            controllers += ["deployment", "replicaset", "root-ca-cert-publisher", "nodelifecycle", "podgc",
                            "disruption"]
        return self._spawn("kube-controller-manager", [
            str(bins.kube_controller_manager),
            f"--kubeconfig={self.workdir / 'pki' / 'controller-manager.kubeconfig'}",
            f"--controllers={','.join(controllers)}",
            f"--service-account-private-key-file={pki['sa_key']}",
            f"--root-ca-file={pki['ca_crt']}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            "--secure-port=0",
            "--use-service-account-credentials=false",
        ])

    # -- readiness --------------------------------------------------------------------

    def _ready(self, state: ClusterState) -> bool:
        pki = self.workdir / "pki"
        ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
        try:
            with urllib.request.urlopen(f"{state.server}/readyz", context=ctx, timeout=2) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError, ssl.SSLError):
            return False

    def _wait_ready(self, state: ClusterState) -> None:
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while time.monotonic() < deadline:
            for name, pid in state.pids.items():
                if not process_alive(pid):
                    log = self.workdir / "logs" / f"{name}.log"
                    tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                    raise RuntimeError(f"{name} exited during start-up; its log ends with:\n{tail}")
            if self._ready(state):
                return
            time.sleep(0.2)
        raise TimeoutError(f"kube-apiserver not ready after {_READY_TIMEOUT_S:.0f}s; see {self.workdir / 'logs'}")

    # -- credentials ----------------------------------------------------------------

    def _pki_paths(self) -> dict[str, Path]:
        pki = self.workdir / "pki"
        return {
            "ca_crt": pki / "ca.crt", "ca_key": pki / "ca.key",
            "serving_crt": pki / "serving.crt", "serving_key": pki / "serving.key",
            "admin_crt": pki / "admin.crt", "admin_key": pki / "admin.key",
            "sa_key": pki / "sa.key", "sa_pub": pki / "sa.pub",
        }

    def _make_pki(self) -> dict[str, Path]:
        (self.workdir / "pki").mkdir(parents=True, exist_ok=True)
        paths = self._pki_paths()
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "365",
                 "-subj", "/CN=tasklease-local-ca", "-keyout", paths["ca_key"], "-out", paths["ca_crt"],
                 "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
        signed_cert(paths, "serving", "/CN=kube-apiserver",
                     "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes.default.svc", "serverAuth")
        signed_cert(paths, "admin", f"/O=system:masters/CN={ADMIN_USER}", None, "clientAuth")
        _openssl("genrsa", "-out", paths["sa_key"], "2048")
        _openssl("rsa", "-in", paths["sa_key"], "-pubout", "-out", paths["sa_pub"])
        return paths

    def _write_kubeconfigs(self, state: ClusterState, pki: dict[str, Path]) -> None:
        config = admin_kubeconfig(server=state.server, ca=pki["ca_crt"], cert=pki["admin_crt"], key=pki["admin_key"])
        self.kubeconfig.parent.mkdir(parents=True, exist_ok=True)
        self.kubeconfig.write_text(yaml.safe_dump(config))
        (self.workdir / "pki" / "controller-manager.kubeconfig").write_text(yaml.safe_dump(config))

    def _write_state(self, state: ClusterState) -> None:
        (self.workdir / _STATE_FILE).write_text(json.dumps(asdict(state), indent=2))


def admin_kubeconfig(*, server: str, ca: Path, cert: Path, key: Path) -> dict[str, object]:
    return {
        "apiVersion": "v1", "kind": "Config", "current-context": "tasklease-local",
        "clusters": [{"name": "tasklease-local", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": ADMIN_USER, "user": {"client-certificate": str(cert), "client-key": str(key)}}],
        "contexts": [{"name": "tasklease-local",
                      "context": {"cluster": "tasklease-local", "user": ADMIN_USER, "namespace": "default"}}],
    }


def namespaced_kubeconfig(kubeconfig: Path, namespace: str, target: Path) -> Path:
    """A copy of `kubeconfig` whose context defaults to `namespace`, as a pod's own namespace does."""
    config = yaml.safe_load(kubeconfig.read_text())
    for context in config.get("contexts", []):
        context["context"]["namespace"] = namespace
    target.write_text(yaml.safe_dump(config))
    return target


def signed_cert(paths: dict[str, Path], name: str, subject: str, san: str | None, usage: str) -> None:
    key, crt = paths[f"{name}_key"], paths[f"{name}_crt"]
    csr = crt.with_suffix(".csr")
    ext = crt.with_suffix(".ext")
    ext.write_text("\n".join(filter(None, [
        "basicConstraints=CA:FALSE", "keyUsage=critical,digitalSignature,keyEncipherment",
        f"extendedKeyUsage={usage}", san])) + "\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", subject, "-keyout", key, "-out", csr)
    _openssl("x509", "-req", "-in", csr, "-CA", paths["ca_crt"], "-CAkey", paths["ca_key"],
             "-CAcreateserial", "-days", "365", "-extfile", ext, "-out", crt)


def _openssl(*args: object) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


def compact_etcd(etcd_port: int) -> int:
    """Compact etcd's history up to its current revision (through etcd's HTTP gateway) and
    return that revision, as the API server does every five minutes: a watch of an uncached
    resource from an older resourceVersion then gets 410 Gone, and so does a paginated list
    that began before (the API server hears of it through `compact_rev_key`, as of its own
    compactions, and its watch cache drops the older list snapshots within 15 s)."""
    def call(path: str, body: dict[str, object]) -> dict[str, Any]:
        request = urllib.request.Request(f"http://127.0.0.1:{etcd_port}/v3/kv/{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(request, timeout=10) as resp:
            answer: dict[str, Any] = json.load(resp)
            return answer

    def b64(text: str) -> str:
        return base64.b64encode(text.encode()).decode()

    revision = int(call("range", {"key": "AA=="})["header"]["revision"])  # any key: the header has the revision
    call("put", {"key": b64("compact_rev_key"), "value": b64(str(revision))})
    call("compaction", {"revision": revision, "physical": True})
    return revision


def audit_files(log: Path) -> list[Path]:
    """`log` and its rotated backups (`audit-<time>.log`), oldest first."""
    backups = sorted(log.parent.glob(f"{log.stem}-*{log.suffix}"))
    return [*backups, log] if log.exists() else backups


def _wait_port_free(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", port))
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"port {port} still in use {timeout_s:.0f}s after its process was killed") \
                        from None
        time.sleep(0.1)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def process_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours is dead for our purposes.
    try:
        return proc_stat(pid)[0] != "Z"
    except OSError:
        return True


def proc_stat(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name (which may hold spaces and
    parentheses): [0] is the state, [11] and [12] the user and system CPU in clock ticks."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def started_in(pid: int, workdir: Path) -> bool:
    """True when `pid` runs and its command line names `workdir`: a pid read from a state file
    may have been reused by an unrelated process since, which must never be signalled."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return process_alive(pid) and any(str(workdir).encode() in arg for arg in cmdline)


def terminate(pid: int, grace_s: float = 10.0) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and process_alive(pid):
        _reap(pid)
        time.sleep(0.05)
    if process_alive(pid):
        os.kill(pid, signal.SIGKILL)
    _reap(pid)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _log(message: str) -> None:
    print(f"tasklease: {message}", file=sys.stderr, flush=True)

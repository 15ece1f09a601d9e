"""One real node on the local control plane: containerd, a kubelet and kube-scheduler, loopback only.

`make node` installs what is missing (Debian's containerd and runc, buildah, debootstrap,
the CNI loopback plugin, iptables), builds the images (`tasklease_dev.images`), starts a
private containerd, imports the images, and joins a kubelet to the cluster `make cluster`
runs. Pods use hostNetwork only. The node's processes run in its cgroups (`tasklease-node`,
and the kubelet's `kubepods` for pods); iptables and ip6tables reject (and count) anything
they send outside loopback, and iptables any connection to the Service range, which on this
machine would route off the box.

`make node-down` puts back everything the kubelet and containerd change outside their
root: processes, mounts, cgroups, the iptables rules, files in host-global paths, and the
kernel sysctls the kubelet sets.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from tasklease_dev import binaries, images
from tasklease_dev.cluster import (
    ClusterState,
    LocalCluster,
    admin_kubeconfig,
    free_port,
    process_alive,
    signed_cert,
    started_in,
    terminate,
)

SERVICE_RANGE = "10.0.0.0/24"  # the apiserver's --service-cluster-ip-range
CGROUP_V2 = Path("/sys/fs/cgroup/unified")
CGROUP_NAME = "tasklease-node"
# The node's processes (kubelet, containerd, shims) run in CGROUP_NAME; runc puts pods in
# kubepods, also in the v2 hierarchy. The rules match both (and their descendants).
NODE_GROUPS = (CGROUP_NAME, "kubepods")
CHAIN = "TASKLEASE-NODE"
# The kubelet sets these on start (protectKernelDefaults: false); node-down restores them.
SYSCTLS = ("vm.overcommit_memory", "kernel.panic", "kernel.panic_on_oops")
# Written by the kubelet and containerd outside their configured directories.
HOST_LEAKS = (Path("/var/lib/kubelet"), Path("/usr/libexec/kubernetes"), Path("/var/log/containers"),
              Path("/var/log/pods"), Path("/run/containerd"))
# Written by containerd's CNI plugins (their cache) where other software may keep state too:
# removed at `down` only when `up` did not find them.
SHARED_LEAKS = (Path("/var/lib/cni"),)
_STATE_FILE = "node.json"
_SYSCTL_FILE = "sysctls.json"
_FRESH_FILE = "fresh-paths.json"
_READY_TIMEOUT_S = 120.0
# Debian packages and a file each one provides.
_PACKAGES = {
    "containerd": "/usr/bin/containerd", "runc": "/usr/sbin/runc", "buildah": "/usr/bin/buildah",
    "debootstrap": "/usr/sbin/debootstrap", "containernetworking-plugins": "/usr/lib/cni/loopback",
    "iptables": "/usr/sbin/iptables", "gcc": "/usr/bin/gcc", "libc6-dev": "/usr/lib/x86_64-linux-gnu/libc.a",
    "openssl": "/usr/bin/openssl",
}


@dataclass
class NodeState:
    name: str
    workdir: str
    kubelet_port: int
    pids: dict[str, int]
    kubeconfig: str
    apiserver_port: int


def require_root() -> None:
    if os.geteuid() != 0:
        raise PermissionError("a node needs root (containerd, runc, mounts, cgroups, iptables): run it as root")


def ensure_packages() -> None:
    """Install from Debian whatever the node needs and is missing (apt-get update once first)."""
    missing = sorted(pkg for pkg, path in _PACKAGES.items() if not Path(path).exists())
    if not missing:
        return
    _log(f"installing {' '.join(missing)} with apt-get...")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env, stdout=subprocess.DEVNULL)
    subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing],
                   check=True, env=env, stdout=subprocess.DEVNULL)


class LocalNode:
    """Starts, finds and stops the node kept in ``workdir``, joined to ``cluster``."""

    def __init__(self, cluster: LocalCluster, workdir: Path, source: Path) -> None:
        self.cluster = cluster
        self.workdir = workdir.resolve()
        self.source = source.resolve()

    @property
    def socket(self) -> Path:
        return self.workdir / "containerd" / "containerd.sock"

    # -- public -----------------------------------------------------------------

    def running(self) -> NodeState | None:
        path = self.workdir / _STATE_FILE
        if not path.exists():
            return None
        state = NodeState(**json.loads(path.read_text()))
        cluster = self.cluster.running()
        if cluster is None or cluster.apiserver_port != state.apiserver_port:
            return None
        if not all(process_alive(pid) for pid in state.pids.values()):
            return None
        return state if self._node_ready(state) else None

    def up(self) -> NodeState:
        require_root()
        found = self.running()
        if found is not None:
            return found
        ensure_packages()
        bins = binaries.ensure_node_binaries()
        archives = [images.ensure_pause(), images.ensure_project_image(self.source)]
        cluster = self.cluster.up(node=True)
        self.down()
        started = time.monotonic()
        name = node_name()
        state = NodeState(name=name, workdir=str(self.workdir), kubelet_port=free_port(), pids={},
                          kubeconfig=cluster.kubeconfig, apiserver_port=cluster.apiserver_port)
        try:
            self.workdir.mkdir(parents=True, exist_ok=True)
            _save_sysctls(self.workdir / _SYSCTL_FILE)
            _save_fresh(self.workdir / _FRESH_FILE)
            for group in NODE_GROUPS:  # before the rules: they name existing groups
                (CGROUP_V2 / group).mkdir(exist_ok=True)
            add_iptables_rules()
            state.pids["containerd"] = self._start_containerd()
            self._write_state(state)
            for archive in archives:
                self.import_image(archive)
            credentials = self._credentials(cluster, name)
            state.pids["kubelet"] = self._start_kubelet(bins.kubelet, state, credentials["node"])
            self._write_state(state)
            state.pids["kube-scheduler"] = self._spawn("kube-scheduler", [
                str(bins.kube_scheduler), *(f"--{flag}={credentials['scheduler']}" for flag in (
                    "kubeconfig", "authentication-kubeconfig", "authorization-kubeconfig")),
                "--leader-elect=false", "--bind-address=127.0.0.1", "--secure-port=0",
            ])
            self._write_state(state)
            self._wait_ready(state)
        except BaseException:
            self.down()
            raise
        _log(f"node {name} Ready in {time.monotonic() - started:.1f}s (kubelet on 127.0.0.1:{state.kubelet_port})")
        return state

    def down(self) -> None:
        """Stop the node and put back everything it changed; harmless when nothing runs."""
        state_file = self.workdir / _STATE_FILE
        pids: dict[str, int] = {}
        if state_file.exists():
            pids = json.loads(state_file.read_text()).get("pids", {})
            name = json.loads(state_file.read_text()).get("name")
            self._forget_node(name)
        for proc in ("kube-scheduler", "kubelet"):
            if pids.get(proc) and started_in(pids[proc], self.workdir):
                terminate(pids[proc])
        if pids.get("containerd") and started_in(pids["containerd"], self.workdir):
            self._remove_containers()
            terminate(pids["containerd"])
        for group in NODE_GROUPS:
            _kill_cgroup(CGROUP_V2 / group)
        remove_iptables_rules()
        unmount_under([self.workdir, *HOST_LEAKS])
        _remove_cgroups()
        for leak in HOST_LEAKS:
            _remove(leak)
        _remove_fresh(self.workdir / _FRESH_FILE)
        _restore_sysctls(self.workdir / _SYSCTL_FILE)
        _remove(self.workdir)

    def import_image(self, archive: Path) -> None:
        """Load an image archive (docker-archive or OCI) into the node's containerd: its pods
        run it with `imagePullPolicy: Never`, no registry."""
        self._ctr("images", "import", str(archive))

    # -- containerd -----------------------------------------------------------------

    def _start_containerd(self) -> int:
        base = self.workdir / "containerd"
        cni = self.workdir / "cni"
        (cni / "net.d").mkdir(parents=True, exist_ok=True)
        # Only loopback: the node's pods are hostNetwork, and this makes the runtime network Ready.
        (cni / "net.d" / "10-loopback.conflist").write_text(json.dumps(
            {"cniVersion": "0.4.0", "name": "loopback-only", "plugins": [{"type": "loopback"}]}))
        config = base / "config.toml"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(_CONTAINERD_CONFIG.format(base=base, cni=cni, opt=self.workdir / "opt",
                                                    pause=images.PAUSE_IMAGE))
        pid = self._spawn("containerd", ["containerd", "--config", str(config)])
        deadline = time.monotonic() + 30
        while not self._ctr_ok("version"):
            if time.monotonic() > deadline or not process_alive(pid):
                raise RuntimeError(f"containerd did not start; see {self.workdir / 'logs' / 'containerd.log'}")
            time.sleep(0.2)
        return pid

    def _ctr(self, *args: str) -> str:
        done = subprocess.run(["ctr", "--address", str(self.socket), "--namespace", "k8s.io", *args],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"ctr {' '.join(args[:2])}: {done.stderr.strip()[-500:]}")
        return done.stdout

    def _ctr_ok(self, *args: str) -> bool:
        try:
            self._ctr(*args)
        except RuntimeError:
            return False
        return True

    def _remove_containers(self) -> None:
        """Kill and remove every container (pods and sandboxes), so containerd unmounts their rootfs."""
        try:
            ids = self._ctr("containers", "list", "--quiet").split()
        except RuntimeError:
            return
        for cid in ids:
            self._ctr_ok("tasks", "kill", "--signal", "SIGKILL", cid)
        for cid in ids:
            self._ctr_ok("tasks", "delete", "--force", cid)
            self._ctr_ok("containers", "delete", cid)

    # -- kubelet ------------------------------------------------------------------------

    def _credentials(self, cluster: ClusterState, name: str) -> dict[str, Path]:
        pki = Path(cluster.workdir) / "pki"
        out = self.workdir / "pki"
        out.mkdir(parents=True, exist_ok=True)
        kubeconfigs = {}
        for who, subject in (("node", f"/O=system:nodes/CN=system:node:{name}"),
                             ("scheduler", "/CN=system:kube-scheduler")):
            paths = {"ca_crt": pki / "ca.crt", "ca_key": pki / "ca.key",
                     f"{who}_crt": out / f"{who}.crt", f"{who}_key": out / f"{who}.key"}
            signed_cert(paths, who, subject, None, "clientAuth")
            kubeconfigs[who] = out / f"{who}.kubeconfig"
            kubeconfigs[who].write_text(yaml.safe_dump(admin_kubeconfig(
                server=cluster.server, ca=pki / "ca.crt", cert=paths[f"{who}_crt"], key=paths[f"{who}_key"])))
        # No Node authorizer on this apiserver (RBAC only): bind the kubelets' group to system:node.
        self._kubectl(cluster, "apply", "-f", "-", input=yaml.safe_dump({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": "tasklease-nodes"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:node"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "system:nodes"}],
        }))
        return kubeconfigs

    def _start_kubelet(self, kubelet: Path, state: NodeState, kubeconfig: Path) -> int:
        root = self.workdir / "kubelet"
        for sub in ("root", "manifests", "pod-logs", "pki", "volume-plugins"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "address": "127.0.0.1", "port": state.kubelet_port, "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": 0,
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(Path(self.cluster.workdir) / "pki" / "ca.crt")}},
            "authorization": {"mode": "Webhook"},
            "cgroupDriver": "cgroupfs",
            "failCgroupV1": False,  # this machine is cgroup v1 (hybrid)
            "failSwapOn": False,
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "podLogsDir": str(root / "pod-logs"),
            "staticPodPath": str(root / "manifests"),
            "volumePluginDir": str(root / "volume-plugins"),
            "makeIPTablesUtilChains": False,
            "protectKernelDefaults": False,  # it sets SYSCTLS; node-down restores them
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
            "imageGCHighThresholdPercent": 100,  # the images were imported by hand: never collect them
            "resolvConf": "",  # hostNetwork pods use 127.0.0.1 only; no DNS for anyone
        }
        config_file = root / "config.yaml"
        config_file.write_text(yaml.safe_dump(config))
        return self._spawn("kubelet", [
            str(kubelet), f"--config={config_file}", f"--kubeconfig={kubeconfig}",
            f"--root-dir={root / 'root'}", f"--cert-dir={root / 'pki'}",
            f"--hostname-override={state.name}", "--v=1",
        ])

    def _node_ready(self, state: NodeState) -> bool:
        cluster = self.cluster.running()
        if cluster is None:
            return False
        done = self._kubectl(cluster, "get", "node", state.name, "-o",
                             "jsonpath={.status.conditions[?(@.type=='Ready')].status}", check=False)
        return done.stdout.strip() == "True"

    def _wait_ready(self, state: NodeState) -> None:
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while not self._node_ready(state):
            for name, pid in state.pids.items():
                if not process_alive(pid):
                    raise RuntimeError(f"{name} exited; see {self.workdir / 'logs' / (name + '.log')}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {state.name} not Ready after {_READY_TIMEOUT_S:.0f}s; "
                                   f"see {self.workdir / 'logs'}")
            time.sleep(0.5)

    def _forget_node(self, name: str | None) -> None:
        cluster = self.cluster.running()
        if name and cluster is not None:
            self._kubectl(cluster, "delete", "node", name, "--ignore-not-found", "--wait=false", check=False)

    def _kubectl(self, cluster: ClusterState, *args: str, input: str | None = None,
                 check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(binaries.ensure_kubectl()), f"--kubeconfig={cluster.kubeconfig}", *args],
                              input=input, capture_output=True, text=True, check=check, timeout=60)

    # -- processes --------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> int:
        logs = self.workdir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        procs = _cgroup() / "cgroup.procs"

        def join_cgroup() -> None:
            # Before exec: every socket the node (and any pod) opens belongs to this group,
            # which the iptables rules match.
            procs.write_text("0")

        with open(logs / f"{name}.log", "ab") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, preexec_fn=join_cgroup)
        return proc.pid

    def _write_state(self, state: NodeState) -> None:
        (self.workdir / _STATE_FILE).write_text(json.dumps(asdict(state), indent=2))


def node_name() -> str:
    """The machine's hostname when /etc/hosts maps it to loopback (the apiserver reaches the
    kubelet by Hostname, and must never ask DNS), else ``localhost``."""
    host = os.uname().nodename
    for line in Path("/etc/hosts").read_text().splitlines():
        fields = line.split("#", 1)[0].split()
        if fields and fields[0].startswith("127.") and host in fields[1:]:
            return host
    return "localhost"


# -- the network fence -------------------------------------------------------------------

# iptables for IPv4, ip6tables for IPv6 (this machine has a global IPv6 route too), with the
# loopback destination of each family.
_FAMILIES = (("iptables", "127.0.0.0/8"), ("ip6tables", "::1/128"))


def iptables_rules(loopback: str = "127.0.0.0/8") -> list[list[str]]:
    """The chain's rules, in order. Comments name them for the e2e's counters."""
    rules = [] if ":" in loopback else [
        ["-d", SERVICE_RANGE, "-m", "comment", "--comment", "tasklease-service-range",
         "-j", "REJECT", "--reject-with", "icmp-net-unreachable"]]
    for group in NODE_GROUPS:
        own = ["-m", "cgroup", "--path", group]
        rules += [
            [*own, "-d", loopback, "-m", "comment", "--comment", "tasklease-node-loopback", "-j", "RETURN"],
            [*own, "-m", "comment", "--comment", "tasklease-node-offbox", "-j", "REJECT"],
        ]
    return rules


def add_iptables_rules() -> None:
    remove_iptables_rules()
    for tool, loopback in _FAMILIES:
        _iptables(tool, "-N", CHAIN)
        for rule in iptables_rules(loopback):
            _iptables(tool, "-A", CHAIN, *rule)
        _iptables(tool, "-I", "OUTPUT", "1", "-j", CHAIN)


def remove_iptables_rules() -> None:
    for tool, _ in _FAMILIES:
        if shutil.which(tool) is None:  # a machine without iptables yet has no rules of ours either
            continue
        while _iptables(tool, "-D", "OUTPUT", "-j", CHAIN, check=False):
            pass
        _iptables(tool, "-F", CHAIN, check=False)
        _iptables(tool, "-X", CHAIN, check=False)


def iptables_counters() -> dict[str, int]:
    """Packets the chain's rules have matched, both families, summed by comment."""
    counters: dict[str, int] = {}
    for tool, _ in _FAMILIES:
        out = subprocess.run([tool, "-w", "-L", CHAIN, "-v", "-n", "-x"],
                             capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if "/* " in line:
                name = line.split("/* ", 1)[1].split(" */", 1)[0]
                counters[name] = counters.get(name, 0) + int(line.split()[0])
    return counters


def _iptables(tool: str, *args: str, check: bool = True) -> bool:
    done = subprocess.run([tool, "-w", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{tool} {' '.join(args)}: {done.stderr.strip()}")
    return done.returncode == 0


# -- cleanup helpers -------------------------------------------------------------------

def _cgroup() -> Path:
    return CGROUP_V2 / CGROUP_NAME


def _kill_cgroup(group: Path) -> None:
    """SIGKILL whatever still runs in a node's group or below it (shims, pods)."""
    if not group.exists():
        return
    deadline = time.monotonic() + 15
    while True:
        pids = [int(p) for g in (group, *group.rglob("*")) if (g / "cgroup.procs").is_file()
                for p in (g / "cgroup.procs").read_text().split()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} in {group} survive SIGKILL")
        time.sleep(0.1)


def node_mounts(roots: list[Path]) -> list[str]:
    """Mount points under any of ``roots``, deepest first."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if any(point == str(r) or point.startswith(f"{r}/") for r in roots):
            found.append(point)
    return sorted(found, key=lambda p: p.count("/"), reverse=True)


def unmount_under(roots: list[Path]) -> None:
    for _ in range(5):
        points = node_mounts(roots)
        if not points:
            return
        for point in points:
            subprocess.run(["umount", point], capture_output=True)
    for point in node_mounts(roots):
        subprocess.run(["umount", "-l", point], capture_output=True)


def node_cgroups() -> list[Path]:
    """The kubelet's cgroups (kubepods) in every hierarchy, and the node's own v2 group."""
    found = [h / "kubepods" for h in Path("/sys/fs/cgroup").iterdir() if (h / "kubepods").is_dir()]
    return found + ([_cgroup()] if _cgroup().exists() else [])


def _remove_cgroups() -> None:
    for top in node_cgroups():
        for group in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            group.rmdir()
        top.rmdir()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def read_sysctls() -> dict[str, str]:
    return {name: Path("/proc/sys", *name.split(".")).read_text().strip() for name in SYSCTLS}


def _save_sysctls(path: Path) -> None:
    # Never overwrite: after an interrupted run the file holds the values from before the kubelet.
    if not path.exists():
        path.write_text(json.dumps(read_sysctls()))


def _save_fresh(path: Path) -> None:
    # Never overwrite, as `_save_sysctls`: after an interrupted run the node made them.
    if not path.exists():
        path.write_text(json.dumps([str(p) for p in SHARED_LEAKS if not p.exists()]))


def _remove_fresh(path: Path) -> None:
    if not path.exists():
        return
    for name in json.loads(path.read_text()):
        _remove(Path(name))
    path.unlink()


def _restore_sysctls(path: Path) -> None:
    if not path.exists():
        return
    for name, value in json.loads(path.read_text()).items():
        Path("/proc/sys", *name.split(".")).write_text(value)
    path.unlink()


def _log(message: str) -> None:
    print(f"tasklease: {message}", file=sys.stderr, flush=True)


_CONTAINERD_CONFIG = """\
version = 2
root = "{base}/root"
state = "{base}/state"
[grpc]
  address = "{base}/containerd.sock"
[ttrpc]
  address = "{base}/containerd.sock.ttrpc"
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "{opt}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause}"
  # kubectl exec/logs stream through here: loopback, any free port.
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  # This VM lacks CAP_SYS_RESOURCE: without this every sandbox fails to start
  # ("can't get final child's PID from pipe: EOF") on oom_score_adj < 0.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{base}/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{cni}/net.d"
"""

"""A real 2-node kind cluster inside a network namespace of our own (`make kind`, `make kind-down`).

`make kind` installs Debian's docker.io, builds every image kind needs (`tasklease_dev.kind_images`),
creates the namespace ``tasklease-kind`` with nothing but loopback, and starts a private dockerd
in it. kind then makes its bridge, its node containers and their pod network there, so every
private address exists only inside that namespace: the host's interfaces, routes and iptables
stay as they were. The cluster comes from `kind-config.yaml` through a generated copy that names
the local node image and leaves out kindnetd (its image is not served): each node gets a
CNI config of ours (Debian's ptp and host-local plugins on the node's pod CIDR) and a route to the
other node's pods. The project image is built from the Dockerfile and loaded with `kind load`.

`make kind-down` deletes the cluster, stops dockerd by pid, and removes the namespace, the
containers, their cgroups, what dockerd leaves in host paths, and restores the kernel sysctls the
nodes' kubelets set (they are not namespaced).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tasklease_dev import binaries, images, kind_images
from tasklease_dev.cluster import process_alive, started_in, terminate
from tasklease_dev.node import node_mounts as mounts_under
from tasklease_dev.node import unmount_under

NETNS = "tasklease-kind"
CGROUP_PARENT = "tasklease-kind"
PROJECT_IMAGE = images.PROJECT_IMAGE
# The kubelet sets these on start (protectKernelDefaults: false); they are the host's.
SYSCTLS = ("vm.overcommit_memory", "vm.panic_on_oom", "kernel.panic", "kernel.panic_on_oops",
           "kernel.keys.root_maxkeys", "kernel.keys.root_maxbytes")
# Created on the host whatever the flags: by dockerd, by docker's bind mount of /lib/modules into
# the nodes, and by `ip netns add` (/run/netns, a mount of itself).
HOST_LEAKS = (Path("/run/docker"), Path("/etc/docker/key.json"), Path("/lib/modules"), Path("/run/runc"),
              Path("/etc/cni"), Path("/var/lib/containers"), Path("/run/containerd"), Path("/run/netns"))
_CGROUPS = Path("/sys/fs/cgroup")
_STATE_FILE = "kind.json"
_SYSCTL_FILE = "sysctls.json"
_PACKAGES = {"docker.io": "/usr/sbin/dockerd", "buildah": "/usr/bin/buildah", "debootstrap": "/usr/sbin/debootstrap",
             "containernetworking-plugins": "/usr/lib/cni/ptp", "iptables": "/usr/sbin/iptables",
             "gcc": "/usr/bin/gcc", "libc6-dev": "/usr/lib/x86_64-linux-gnu/libc.a"}
_CAP_SYS_RESOURCE = 24
_READY_TIMEOUT_S = 300.0


@dataclass
class KindState:
    name: str
    workdir: str
    kubeconfig: str
    pids: dict[str, int]
    fresh_leaks: list[str]  # host paths that did not exist before: removed by down
    # Host paths that were no mount points before (`ip netns add` mounts /run/netns on itself):
    # unmounted by down.
    fresh_mounts: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Prepared:
    server_tarball: Path
    base: str
    project_image: Path
    kind: Path


def prepare(source: Path) -> Prepared:
    """What `up` needs that takes long the first time (Debian packages, kind, every component from
    Go modules, the base image, the project's image), built into the cache. `make kind-e2e` runs it
    before its tests, so that a cold build is not bounded by a test's timeout."""
    require_root()
    ensure_packages()
    return Prepared(server_tarball=kind_images.server_tarball(), base=kind_images.ensure_base(),
                    project_image=images.ensure_project_image(source), kind=kind_images.kind_binary())


def in_netns() -> list[str]:
    """The argv prefix that runs a command in the cluster's network namespace."""
    return ["nsenter", f"--net=/run/netns/{NETNS}"]


class KindCluster:
    """Starts, finds and stops the kind cluster kept in ``workdir``, from ``config`` (kind-config.yaml)."""

    def __init__(self, workdir: Path, source: Path) -> None:
        self.workdir = workdir.resolve()
        self.source = source.resolve()
        self.config = self.source / "kind-config.yaml"
        self.name = str(yaml.safe_load(self.config.read_text()).get("name", "kind"))

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    @property
    def socket(self) -> Path:
        return self.workdir / "docker.sock"

    def docker(self) -> list[str]:
        return [_docker_cli(), f"--host=unix://{self.socket}"]

    # -- public ---------------------------------------------------------------------------

    def running(self) -> KindState | None:
        path = self.workdir / _STATE_FILE
        if not path.exists():
            return None
        state = KindState(**json.loads(path.read_text()))
        if not all(process_alive(pid) for pid in state.pids.values()):
            return None
        return state if self._nodes_ready() else None

    def up(self) -> KindState:
        require_root()
        found = self.running()
        if found is not None:
            return found
        if (self.workdir.parent / "node" / "node.json").exists():
            # Both set the host's sysctls and put them back: never one over the other.
            raise RuntimeError("the local node is up: run `make node-down` first")
        built = prepare(self.source)
        tarball, base, project, kind = built.server_tarball, built.base, built.project_image, built.kind
        self.down()
        started = time.monotonic()
        self.workdir.mkdir(parents=True, exist_ok=True)
        state = KindState(name=self.name, workdir=str(self.workdir), kubeconfig=str(self.kubeconfig), pids={},
                          fresh_leaks=[str(p) for p in HOST_LEAKS if not p.exists()],
                          fresh_mounts=[str(p) for p in HOST_LEAKS if not mounts_under([p])])
        try:
            _save_sysctls(self.workdir / _SYSCTL_FILE)
            self._write_state(state)
            _run(["ip", "netns", "add", NETNS])
            _run(["ip", "-n", NETNS, "link", "set", "lo", "up"])
            state.pids["dockerd"] = self._start_dockerd()
            self._write_state(state)
            if not self._docker_ok("image", "inspect", kind_images.NODE_IMAGE):
                if not self._docker_ok("image", "inspect", base):
                    kind_images.load_into_docker(self.docker(), base)
                _log("building kind's node image (kind build node-image, no registry)...")
                self._kind(kind, "build", "node-image", "--type", "file", str(tarball),
                           "--base-image", base, "--image", kind_images.NODE_IMAGE)
            config = self.workdir / "kind-config.yaml"
            config.write_text(yaml.safe_dump(local_config(yaml.safe_load(self.config.read_text()))))
            self._kind(kind, "create", "cluster", "--config", str(config), "--kubeconfig", str(self.kubeconfig),
                       "--retain")
            self._pod_network()
            self._dns_without_upstream()
            subprocess.run([*self.docker(), "load", "-q", "-i", str(project)], check=True,
                           stdout=subprocess.DEVNULL)
            self._kind(kind, "load", "docker-image", PROJECT_IMAGE, "--name", self.name)
            self._wait_ready()
        except BaseException:
            _log(f"kind up failed; logs in {self.workdir / 'logs'}; taking it down")
            self.down()
            raise
        _log(f"kind cluster {self.name} Ready in {time.monotonic() - started:.1f}s "
             f"(in network namespace {NETNS}; KUBECONFIG={self.kubeconfig})")
        return state

    def down(self) -> None:
        """Stop everything up started and put the host back; harmless when nothing runs."""
        state_file = self.workdir / _STATE_FILE
        state = KindState(**json.loads(state_file.read_text())) if state_file.exists() else None
        dockerd = state.pids.get("dockerd") if state else None
        if dockerd and started_in(dockerd, self.workdir):
            kind = kind_images.kind_binary()
            self._kind(kind, "delete", "cluster", "--name", self.name, check=False)
            ids = subprocess.run([*self.docker(), "ps", "-aq"], capture_output=True, text=True).stdout.split()
            if ids:
                subprocess.run([*self.docker(), "rm", "-f", "-v", *ids], capture_output=True)
            terminate(dockerd, grace_s=30)
        _kill_cgroups()
        if (Path("/run/netns") / NETNS).exists():
            _run(["ip", "netns", "delete", NETNS])
        fresh = [Path(leak) for leak in (state.fresh_leaks if state else [])]
        unmount_under([self.workdir, data_root(), *fresh, *(Path(m) for m in (state.fresh_mounts if state else []))])
        _remove_cgroups()
        for leak in fresh:
            _remove(leak)
        _restore_sysctls(self.workdir / _SYSCTL_FILE)
        if self.workdir.exists():
            shutil.rmtree(self.workdir)

    # -- dockerd ----------------------------------------------------------------------------

    def _start_dockerd(self) -> int:
        config: dict[str, Any] = {
            "data-root": str(data_root()),  # kept: the node image stays built between runs
            "exec-root": str(self.workdir / "exec"),
            "pidfile": str(self.workdir / "docker.pid"),
            "hosts": [f"unix://{self.socket}"],
            "storage-driver": "overlay2",
            "cgroup-parent": CGROUP_PARENT,
            # Its embedded DNS gets no upstream: nothing is resolved outside the namespace.
            "dns": ["127.0.0.1"],
        }
        if not _has_cap_sys_resource():
            # `docker run --privileged` asks for every capability; runc then fails on the one
            # this machine's bounding set lacks. The wrapper drops it from the OCI spec.
            wrapper = self.workdir / "runc-without-sys-resource"
            wrapper.write_text(_RUNC_WRAPPER.format(python=sys.executable, runc=shutil.which("runc") or "runc"))
            wrapper.chmod(0o755)
            config["runtimes"] = {"tasklease-runc": {"path": str(wrapper)}}
            config["default-runtime"] = "tasklease-runc"
        daemon_json = self.workdir / "daemon.json"
        daemon_json.write_text(json.dumps(config, indent=2))
        logs = self.workdir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with open(logs / "dockerd.log", "ab") as out:
            proc = subprocess.Popen([*in_netns(), "dockerd", f"--config-file={daemon_json}"], stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 60
        while not self._docker_ok("info"):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"dockerd did not start; see {logs / 'dockerd.log'}")
            time.sleep(0.3)
        return proc.pid

    def _docker_ok(self, *args: str) -> bool:
        return subprocess.run([*self.docker(), *args], capture_output=True).returncode == 0

    def _kind(self, kind: Path, *args: str, check: bool = True) -> None:
        logs = self.workdir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "DOCKER_HOST": f"unix://{self.socket}", "KUBECONFIG": str(self.kubeconfig),
               "PATH": f"{_docker_dir()}:{os.environ.get('PATH', '')}"}
        with open(logs / "kind.log", "ab") as out:
            done = subprocess.run([*in_netns(), str(kind), *args], env=env, stdout=out, stderr=subprocess.STDOUT)
        if check and done.returncode != 0:
            raise RuntimeError(f"kind {' '.join(args[:3])} failed (exit {done.returncode}); see {logs / 'kind.log'}")

    # -- the pod network --------------------------------------------------------------------

    def kubectl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*in_netns(), str(binaries.ensure_kubectl()), f"--kubeconfig={self.kubeconfig}",
                               *args], capture_output=True, text=True, check=check, timeout=120)

    def _pod_network(self) -> None:
        """Each node: a CNI config on its pod CIDR, and a route to every other node's pods."""
        nodes: dict[str, tuple[str, str]] = {}
        deadline = time.monotonic() + 120
        while True:
            listed = json.loads(self.kubectl("get", "nodes", "-o", "json").stdout)["items"]
            nodes = {n["metadata"]["name"]: (n["spec"].get("podCIDR", ""), next(
                a["address"] for a in n["status"]["addresses"] if a["type"] == "InternalIP")) for n in listed}
            if len(nodes) == len(yaml.safe_load(self.config.read_text())["nodes"]) and all(
                    cidr for cidr, _ in nodes.values()):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"nodes without a pod CIDR after 120s: {nodes}")
            time.sleep(1)
        for name, (cidr, _) in nodes.items():
            conflist = cni_config(cidr)
            subprocess.run([*self.docker(), "exec", "-i", name, "sh", "-c",
                            "cat > /etc/cni/net.d/10-tasklease.conflist"], input=conflist, text=True, check=True)
            for other, (other_cidr, other_ip) in nodes.items():
                if other != name:
                    _run([*self.docker(), "exec", name, "ip", "route", "replace", other_cidr, "via", other_ip])

    def _dns_without_upstream(self) -> None:
        """CoreDNS answers for the cluster only. Its upstream would be the node's resolv.conf, a
        127.0.0.x address (docker's DNS), which in a pod's namespace is CoreDNS itself: a loop."""
        corefile = json.loads(self.kubectl("get", "configmap", "coredns", "-n", "kube-system", "-o", "json").stdout)
        text = corefile["data"]["Corefile"]
        text = re.sub(r"\n\s*forward \. /etc/resolv\.conf \{[^}]*\}", "", text)
        text = re.sub(r"\n\s*loop\n", "\n", text)
        patch = json.dumps({"data": {"Corefile": text}})
        self.kubectl("patch", "configmap", "coredns", "-n", "kube-system", "--type=merge", "-p", patch)
        self.kubectl("rollout", "restart", "deployment/coredns", "-n", "kube-system")

    def _nodes_ready(self) -> bool:
        if not self.kubeconfig.exists() or not (Path("/run/netns") / NETNS).exists():
            return False
        done = self.kubectl("get", "nodes", "-o",
                            "jsonpath={.items[*].status.conditions[?(@.type=='Ready')].status}", check=False)
        statuses = done.stdout.split()
        return done.returncode == 0 and len(statuses) == 2 and set(statuses) == {"True"}

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while not self._nodes_ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"kind nodes not Ready after {_READY_TIMEOUT_S:.0f}s")
            time.sleep(1)
        self.kubectl("rollout", "status", "-n", "kube-system", "deployment/coredns",
                     f"--timeout={_READY_TIMEOUT_S:.0f}s")

    def _write_state(self, state: KindState) -> None:
        (self.workdir / _STATE_FILE).write_text(json.dumps(asdict(state), indent=2))


def local_config(config: dict[str, Any]) -> dict[str, Any]:
    """kind-config.yaml as this machine runs it: the local node image, our CNI instead of kindnetd,
    and on a cgroup v1 host the kubelet told to accept it."""
    generated: dict[str, Any] = json.loads(json.dumps(config))
    for node in generated["nodes"]:
        node["image"] = kind_images.NODE_IMAGE
    generated.setdefault("networking", {})["disableDefaultCNI"] = True
    if not (_CGROUPS / "cgroup.controllers").exists():
        generated.setdefault("kubeadmConfigPatches", []).append(yaml.safe_dump(
            {"kind": "KubeletConfiguration", "apiVersion": "kubelet.config.k8s.io/v1beta1", "failCgroupV1": False}))
    return generated


def cni_config(pod_cidr: str) -> str:
    """A point-to-point veth per pod (routed by the node, so Service traffic is NATed both ways)."""
    return json.dumps({"cniVersion": "0.4.0", "name": "tasklease", "plugins": [
        {"type": "ptp", "ipMasq": False, "mtu": 1500,
         "ipam": {"type": "host-local", "ranges": [[{"subnet": pod_cidr}]], "routes": [{"dst": "0.0.0.0/0"}]}},
        {"type": "portmap", "capabilities": {"portMappings": True}},
    ]})


def data_root() -> Path:
    return binaries.cache_root() / "kind" / "docker"


def require_root() -> None:
    if os.geteuid() != 0:
        raise PermissionError("kind here needs root (a network namespace, dockerd, sysctls): run it as root")


def ensure_packages() -> None:
    missing = sorted(pkg for pkg, path in _PACKAGES.items() if not Path(path).exists())
    if not missing:
        return
    _log(f"installing {' '.join(missing)} with apt-get...")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env, stdout=subprocess.DEVNULL)
    subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing],
                   check=True, env=env, stdout=subprocess.DEVNULL)


# -- what the e2e compares --------------------------------------------------------------------


def host_snapshot() -> dict[str, Any]:
    """What kind could change on this machine, to compare after `make kind-down`."""
    def out(*argv: str) -> list[str]:
        done = subprocess.run(list(argv), capture_output=True, text=True)
        return sorted(done.stdout.splitlines())
    # Counters move on their own: only rules and chain names.
    rules = sorted(line.split()[0] if line.startswith(":") else line
                   for tool in ("iptables-save", "ip6tables-save") for line in out(tool)
                   if line.startswith(("-", ":")))
    return {
        "sysctls": read_sysctls(),
        "addresses": out("ip", "-o", "address"), "links": [line.split("<")[0] for line in out("ip", "-o", "link")],
        "routes": out("ip", "route") + out("ip", "-6", "route"), "iptables": rules,
        "netns": out("ip", "netns", "list"),
        "paths": {str(p): p.exists() for p in HOST_LEAKS},
        "mounts": mounts_under(list(HOST_LEAKS)),
        "cgroups": [str(h / CGROUP_PARENT) for h in _hierarchies() if (h / CGROUP_PARENT).exists()],
    }


def read_sysctls() -> dict[str, str]:
    return {name: Path("/proc/sys", *name.split(".")).read_text().strip() for name in SYSCTLS}


def _save_sysctls(path: Path) -> None:
    if not path.exists():  # after an interrupted run the file holds the values from before
        path.write_text(json.dumps(read_sysctls()))


def _restore_sysctls(path: Path) -> None:
    if path.exists():
        for name, value in json.loads(path.read_text()).items():
            Path("/proc/sys", *name.split(".")).write_text(value)
        path.unlink()


# -- cleanup helpers ------------------------------------------------------------------------------


def _hierarchies() -> list[Path]:
    if not _CGROUPS.is_dir():
        return []
    return [h for h in _CGROUPS.iterdir() if h.is_dir() and not h.is_symlink()]


def _kill_cgroups() -> None:
    """SIGKILL whatever still runs under our cgroup parent (node containers, their pods)."""
    deadline = time.monotonic() + 20
    while True:
        pids = {int(p) for h in _hierarchies() if (h / CGROUP_PARENT).is_dir()
                for g in (h / CGROUP_PARENT, *(h / CGROUP_PARENT).rglob("*"))
                if (g / "cgroup.procs").is_file() for p in _read(g / "cgroup.procs").split()}
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {sorted(pids)} under the {CGROUP_PARENT} cgroups survive SIGKILL")
        time.sleep(0.2)


def _remove_cgroups() -> None:
    for hierarchy in _hierarchies():
        top = hierarchy / CGROUP_PARENT
        if not top.is_dir():
            continue
        for group in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            group.rmdir()
        top.rmdir()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _has_cap_sys_resource() -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapBnd:"):
            return bool(int(line.split()[1], 16) >> _CAP_SYS_RESOURCE & 1)
    return True


def _docker_dir() -> Path:
    """Where Debian's docker client is: kind calls `docker`, and it must match Debian's dockerd."""
    return Path("/usr/bin") if Path("/usr/bin/docker").exists() else Path(shutil.which("docker") or "/usr/bin").parent


def _docker_cli() -> str:
    return str(_docker_dir() / "docker")


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv[:6])}` failed (exit {done.returncode}): {done.stderr.strip()[-500:]}")


def _log(message: str) -> None:
    print(f"tasklease: {message}", file=sys.stderr, flush=True)


# dockerd's runtime: runc, minus CAP_SYS_RESOURCE in the capability sets of what it starts
# (a container's spec on `create`, a process's on `exec`).
_RUNC_WRAPPER = """\
#!{python}
import json, os, sys
args = sys.argv[1:]
for flag, key in (("--bundle", "config.json"), ("--process", None)):
    if flag in args and ("create" in args or "exec" in args):
        path = args[args.index(flag) + 1]
        path = os.path.join(path, key) if key else path
        with open(path) as f:
            spec = json.load(f)
        caps = (spec.get("process", {{}}) if key else spec).get("capabilities", {{}})
        for name in caps:
            caps[name] = [c for c in caps[name] if c != "CAP_SYS_RESOURCE"]
        with open(path, "w") as f:
            json.dump(spec, f)
os.execv("{runc}", ["runc", *args])
"""

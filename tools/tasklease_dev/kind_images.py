"""kind's images without a registry: its binaries from Go modules, its base from Debian, its node image by kind.

`kind build node-image --type file` takes a Kubernetes server tarball: kubeadm, kubelet and
kubectl, plus the control plane's images as docker archives. It pulls every other image it
preloads unless an archive already names it, so ``kube-apiserver.tar`` here carries all of
them: etcd, CoreDNS, pause, local-path-provisioner and its helper, and an image tagged as
kindnetd that is never run (the cluster is made with ``disableDefaultCNI``; `tasklease_dev.kind`
configures the pod network itself). The base image is a debootstrap'd Debian with systemd,
Debian's runc and CNI plugins, containerd built from Go modules, and our own entrypoint.
Everything is cached under the binary cache, keyed by the versions it is built from.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from tasklease_dev import binaries, images

KIND_VERSION = "v0.33.0"
CONTAINERD_VERSION = "v2.3.4"
CRICTL_VERSION = "v1.34.0"
COREDNS_VERSION = "v1.13.1"
LOCAL_PATH_VERSION = "v0.0.30"
# What kubeadm v1.35 and kind v0.33.0 look for (`kubeadm config images list`, kind's
# pkg/build/nodeimage/const_*.go): the names are compared as plain strings.
ETCD_TAG = "3.6.6-0"
PAUSE = "registry.k8s.io/pause:3.10"
KINDNETD = "docker.io/kindest/kindnetd:v20260820-69b56db7"
LOCAL_PATH = "docker.io/kindest/local-path-provisioner:v20260820-69b56db7"
LOCAL_PATH_HELPER = "docker.io/kindest/local-path-helper:v20260131-7181c60a"
BASE_IMAGE = "localhost/tasklease/kind-base:bookworm"
NODE_IMAGE = f"localhost/tasklease/kind-node:{binaries.KUBERNETES_VERSION}"

# The node's Debian: systemd as PID 1, what kubelet, kube-proxy and containerd call.
_BASE_PACKAGES = ("systemd,systemd-sysv,dbus,iproute2,iptables,conntrack,ethtool,kmod,util-linux,mount,"
                  "libseccomp2,pigz,procps,ca-certificates,runc,containernetworking-plugins,bash")
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def kind_binary() -> Path:
    target = binaries.cache_root() / f"kind-{KIND_VERSION}" / "bin" / "kind"
    if not target.exists():
        binaries._go_build(module=f"sigs.k8s.io/kind {KIND_VERSION}", packages=[f"sigs.k8s.io/kind@{KIND_VERSION}"],
                           replaces=[], ldflags="-s -w", out_dir=target.parent, label=f"kind {KIND_VERSION}")
    return target


def _tool(name: str, version: str, module: str, packages: list[str], ldflags: str = "-s -w") -> Path:
    out = binaries.cache_root() / f"{name}-{version}" / "bin"
    if not out.is_dir() or not any(out.iterdir()):
        binaries._go_build(module=f"{module} {version}", packages=[f"{p}@{version}" for p in packages],
                           replaces=[], ldflags=ldflags, out_dir=out, label=f"{name} {version}")
    return out


def containerd_dir() -> Path:
    base = "github.com/containerd/containerd/v2"
    return _tool("containerd", CONTAINERD_VERSION, base,
                 [f"{base}/cmd/{c}" for c in ("containerd", "ctr", "containerd-shim-runc-v2")],
                 ldflags=f"-s -w -X {base}/version.Version={CONTAINERD_VERSION}")


def crictl_dir() -> Path:
    return _tool("crictl", CRICTL_VERSION, "sigs.k8s.io/cri-tools", ["sigs.k8s.io/cri-tools/cmd/crictl"],
                 ldflags=f"-s -w -X sigs.k8s.io/cri-tools/pkg/version.Version={CRICTL_VERSION}")


def coredns_dir() -> Path:
    return _tool("coredns", COREDNS_VERSION, "github.com/coredns/coredns", ["github.com/coredns/coredns"])


def local_path_dir() -> Path:
    return _tool("local-path-provisioner", LOCAL_PATH_VERSION, "github.com/rancher/local-path-provisioner",
                 ["github.com/rancher/local-path-provisioner"])


def kubernetes_dir() -> Path:
    """kubeadm, kubelet, kubectl, kube-proxy and kube-scheduler beside the control plane's binaries."""
    bin_dir = binaries.kubernetes_bin_dir()
    wanted = ("kubeadm", "kubelet", "kubectl", "kube-proxy", "kube-scheduler")
    if not all((bin_dir / w).exists() for w in wanted):
        binaries._build_kubernetes(binaries.KUBERNETES_VERSION, bin_dir,
                                   commands=[w for w in wanted if not (bin_dir / w).exists()], with_etcd=False)
    binaries.ensure_kubernetes()  # kube-apiserver, kube-controller-manager and etcd
    return bin_dir


def ensure_all_binaries() -> None:
    kind_binary()
    kubernetes_dir()
    containerd_dir()
    crictl_dir()
    coredns_dir()
    local_path_dir()


# -- images ----------------------------------------------------------------------------------


def cache_key() -> str:
    return f"{binaries.KUBERNETES_VERSION}-kind{KIND_VERSION}-containerd{CONTAINERD_VERSION}-v1"


def server_tarball_path() -> Path:
    return images.images_dir() / f"kind-kubernetes-server-{cache_key()}.tar.gz"


def server_tarball() -> Path:
    """The Kubernetes server tarball `kind build node-image --type file` reads, built once."""
    target = server_tarball_path()
    if target.exists():
        return target
    ensure_all_binaries()
    k8s = kubernetes_dir()
    with tempfile.TemporaryDirectory(prefix="tasklease-kind-images-") as tmp:
        work = Path(tmp)
        archives: dict[str, list[Path]] = {"kube-apiserver": [], "kube-controller-manager": [],
                                           "kube-scheduler": [], "kube-proxy": []}
        version = binaries.KUBERNETES_VERSION
        for name in ("kube-apiserver", "kube-controller-manager", "kube-scheduler"):
            archives[name].append(_static_image(work, f"registry.k8s.io/{name}:{version}", k8s / name))
        archives["kube-proxy"].append(_on_base_image(work, f"registry.k8s.io/kube-proxy:{version}",
                                                     k8s / "kube-proxy"))
        extra = archives["kube-apiserver"]
        extra.append(_static_image(work, f"registry.k8s.io/etcd:{ETCD_TAG}", k8s / "etcd"))
        extra.append(_static_image(work, f"registry.k8s.io/coredns/coredns:{COREDNS_VERSION}",
                                   coredns_dir() / "coredns", entrypoint="/coredns"))
        extra.append(_pause_as(work, PAUSE))
        extra.append(_static_image(work, LOCAL_PATH, local_path_dir() / "local-path-provisioner"))
        extra.append(_on_base_image(work, LOCAL_PATH_HELPER, None))
        # Never run (disableDefaultCNI), but kind preloads it: the pause binary under its name.
        extra.append(_pause_as(work, KINDNETD))
        server = work / "kubernetes"
        (server / "server" / "bin").mkdir(parents=True)
        (server / "version").write_text(version + "\n")
        for name in ("kubeadm", "kubelet", "kubectl"):
            shutil.copy2(k8s / name, server / "server" / "bin" / name)
        for name, parts in archives.items():
            merge_archives(parts, server / "server" / "bin" / f"{name}.tar")
        partial = target.with_suffix(".partial")
        with tarfile.open(partial, "w:gz", compresslevel=1) as out:
            out.add(server, arcname="kubernetes")
        partial.rename(target)
    return target


def merge_archives(parts: list[Path], target: Path) -> None:
    """Several docker-archive tarballs as one, `repositories` first (kind reads the first of the
    two metadata files it finds, and from manifest.json only the first image's tags)."""
    manifest: list[object] = []
    repositories: dict[str, dict[str, str]] = {}
    seen: set[str] = set()
    with tarfile.open(target, "w") as out:
        for part in parts:
            with tarfile.open(part) as src:
                manifest += json.loads(_member(src, "manifest.json"))
                for repo, tags in json.loads(_member(src, "repositories") or b"{}").items():
                    repositories.setdefault(repo, {}).update(tags)
        for name, data in (("repositories", json.dumps(repositories)), ("manifest.json", json.dumps(manifest))):
            info = tarfile.TarInfo(name)
            info.size = len(data.encode())
            out.addfile(info, io.BytesIO(data.encode()))
        for part in parts:
            with tarfile.open(part) as src:
                for member in src.getmembers():
                    if member.name in ("manifest.json", "repositories") or member.name in seen:
                        continue
                    seen.add(member.name)
                    out.addfile(member, src.extractfile(member) if member.isfile() else None)


def _member(archive: tarfile.TarFile, name: str) -> bytes:
    try:
        found = archive.extractfile(name)
    except KeyError:
        return b""
    return found.read() if found else b""


def _repositories(archive: Path, image: str) -> None:
    """Add the `repositories` file buildah's docker-archive lacks, naming ``image`` fully."""
    repo, tag = image.rsplit(":", 1)
    with tarfile.open(archive) as src:
        manifest = json.loads(_member(src, "manifest.json"))
    image_id = manifest[0]["Config"].removesuffix(".json").removeprefix("sha256:")
    data = json.dumps({repo: {tag: image_id}}).encode()
    with tarfile.open(archive, "a") as out:
        info = tarfile.TarInfo("repositories")
        info.size = len(data)
        out.addfile(info, io.BytesIO(data))


def _static_image(work: Path, image: str, binary: Path, entrypoint: str | None = None) -> Path:
    """An image of one static binary on an empty filesystem (how the upstream images are made)."""
    path = entrypoint or f"/usr/local/bin/{binary.name}"
    container = images._buildah_out("from", "scratch")
    try:
        images._buildah("copy", container, str(binary), path)
        images._buildah("config", "--env", f"PATH={_PATH}", "--entrypoint", json.dumps([path]), container)
        images._buildah("commit", "-q", container, image)
    finally:
        images._buildah("rm", container)
    return _save(work, image)


def _on_base_image(work: Path, image: str, binary: Path | None) -> Path:
    """kube-proxy (iptables, conntrack) and local-path's helper (a shell) on the node's Debian."""
    container = images._buildah_out("from", "--pull=never", ensure_base())
    try:
        if binary is not None:
            images._buildah("copy", container, str(binary), f"/usr/local/bin/{binary.name}")
        images._buildah("config", "--entrypoint", "[]", "--cmd", '["/bin/sh"]', container)
        images._buildah("commit", "-q", container, image)
    finally:
        images._buildah("rm", container)
    return _save(work, image)


def _pause_as(work: Path, image: str) -> Path:
    """Our pause image (`tasklease_dev.images`) under another name."""
    images._buildah("pull", "-q", f"docker-archive:{images.ensure_pause()}")
    images._buildah("tag", images.PAUSE_IMAGE, image)
    return _save(work, image)


def _save(work: Path, image: str) -> Path:
    target = work / (image.replace("/", "_").replace(":", "_") + ".tar")
    images._buildah("push", "-q", image, f"docker-archive:{target}:{image}")
    _repositories(target, image)
    return target


def ensure_base() -> str:
    """The node base image in buildah's store (its rootfs debootstrap'd once, cached as a tarball)."""
    if images._buildah_ok("inspect", "--type", "image", BASE_IMAGE):
        return BASE_IMAGE
    rootfs_tar = images.images_dir() / f"kind-base-rootfs-{CONTAINERD_VERSION}.tar"
    if not rootfs_tar.exists():
        images._log("debootstrapping the kind node's Debian rootfs (first time only; a few minutes)...")
        with tempfile.TemporaryDirectory(prefix="tasklease-kind-rootfs-") as tmp:
            rootfs = Path(tmp) / "rootfs"
            images._run(["debootstrap", "--variant=minbase", f"--include={_BASE_PACKAGES}", "bookworm",
                         str(rootfs), images.DEBIAN_MIRROR])
            _furnish(rootfs)
            partial = rootfs_tar.with_suffix(".partial")
            images._run(["tar", "-C", str(rootfs), "--numeric-owner", "-cf", str(partial), "."])
            partial.rename(rootfs_tar)
    container = images._buildah_out("from", "scratch")
    try:
        images._buildah("add", container, str(rootfs_tar), "/")
        images._buildah("config", "--env", f"PATH={_PATH}", "--env", "container=docker",
                        "--stop-signal", "SIGRTMIN+3",
                        "--entrypoint", '["/usr/local/bin/entrypoint", "/sbin/init"]', container)
        images._buildah("commit", "-q", container, BASE_IMAGE)
    finally:
        images._buildah("rm", container)
    return BASE_IMAGE


def _furnish(rootfs: Path) -> None:
    """What kind expects in a node beside Debian: containerd, crictl, units, configs, an entrypoint."""
    for junk in ("usr/share/doc", "usr/share/man", "usr/share/locale", "var/lib/apt/lists", "var/cache/apt"):
        shutil.rmtree(rootfs / junk, ignore_errors=True)
    local_bin = rootfs / "usr" / "local" / "bin"
    for tool in (*containerd_dir().iterdir(), *crictl_dir().iterdir()):
        shutil.copy2(tool, local_bin / tool.name)
    (rootfs / "opt" / "cni").mkdir(parents=True, exist_ok=True)
    (rootfs / "opt" / "cni" / "bin").symlink_to("/usr/lib/cni")
    for directory in ("etc/kubernetes/manifests", "etc/containerd", "etc/systemd/system/kubelet.service.d",
                      "etc/cni/net.d", "kind"):
        (rootfs / directory).mkdir(parents=True, exist_ok=True)
    for name, text in _NODE_FILES.items():
        (rootfs / name).write_text(text)
    (local_bin / "entrypoint").chmod(0o755)
    # Units that make no sense in a container: none enabled but ours and systemd's early boot.
    system = rootfs / "lib" / "systemd" / "system"
    for wants in [*(system / t for t in ("multi-user.target.wants", "local-fs.target.wants", "basic.target.wants")),
                  *(rootfs / "etc" / "systemd" / "system").glob("*.wants")]:
        for link in wants.glob("*"):
            link.unlink()
    sockets = system / "sockets.target.wants"
    for unit in [*sockets.glob("*udev*"), *sockets.glob("*initctl*"),
                 system / "sysinit.target.wants" / "systemd-tmpfiles-setup.service"]:
        unit.unlink(missing_ok=True)
    wants = rootfs / "etc" / "systemd" / "system" / "multi-user.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    for name in ("containerd.service", "kubelet.service"):
        (wants / name).symlink_to(f"/etc/systemd/system/{name}")
    # Units that would change the host from a privileged container: kernel sysctls, modules,
    # binfmt handlers, the clock.
    for masked in ("systemd-sysctl.service", "systemd-modules-load.service", "systemd-binfmt.service",
                 "proc-sys-fs-binfmt_misc.automount", "systemd-timesyncd.service"):
        (rootfs / "etc" / "systemd" / "system" / masked).symlink_to("/dev/null")
    with (rootfs / "etc" / "systemd" / "journald.conf").open("a") as conf:
        conf.write("ReadKMsg=no\n")
    (rootfs / "etc" / "machine-id").write_text("")


def load_into_docker(docker: list[str], image: str) -> None:
    """Copy an image from buildah's store into the private dockerd (`docker load`)."""
    with tempfile.TemporaryDirectory(prefix="tasklease-kind-load-") as tmp:
        archive = Path(tmp) / "image.tar"
        images._buildah("push", "-q", image, f"docker-archive:{archive}:{image}")
        subprocess.run([*docker, "load", "-q", "-i", str(archive)], check=True, stdout=subprocess.DEVNULL)


# Written by us for this project: the node's systemd units, containerd's and crictl's
# configs, and the entrypoint that readies a privileged container for systemd and kubelet.
_NODE_FILES = {
    "etc/systemd/system/containerd.service": """\
[Unit]
Description=containerd
After=network.target local-fs.target

[Service]
ExecStart=/usr/local/bin/containerd
Type=notify
Delegate=yes
KillMode=process
Restart=always
RestartSec=1
LimitNOFILE=infinity
TasksMax=infinity

[Install]
WantedBy=multi-user.target
""",
    "etc/systemd/system/kubelet.service": """\
[Unit]
Description=kubelet
ConditionPathExists=/var/lib/kubelet/config.yaml

[Service]
ExecStart=/usr/bin/kubelet
Restart=always
StartLimitInterval=0
RestartSec=1s
Slice=kubelet.slice
KillMode=process

[Install]
WantedBy=multi-user.target
""",
    # kubeadm writes kubeadm-flags.env and the two kubeconfigs; kind's kubeadm config sets cgroupRoot /kubelet.
    "etc/systemd/system/kubelet.service.d/10-kubeadm.conf": """\
[Service]
EnvironmentFile=-/var/lib/kubelet/kubeadm-flags.env
ExecStartPre=/bin/sh -c "for c in /sys/fs/cgroup/*/; do mkdir -p $c/kubelet; done"
ExecStart=
ExecStart=/usr/bin/kubelet --bootstrap-kubeconfig=/etc/kubernetes/bootstrap-kubelet.conf \\
  --kubeconfig=/etc/kubernetes/kubelet.conf --config=/var/lib/kubelet/config.yaml \\
  --runtime-cgroups=/system.slice/containerd.service $KUBELET_KUBEADM_ARGS
""",
    "etc/systemd/system/kubelet.slice": "[Unit]\nDescription=kubelet\nBefore=slices.target\n",
    "etc/containerd/config.toml": """\
version = 2

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "registry.k8s.io/pause:3.10"
  tolerate_missing_hugepages_controller = true
  # The machines this runs on may lack CAP_SYS_RESOURCE: a negative oom_score_adj is refused.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    discard_unpacked_layers = true
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = true
""",
    "etc/crictl.yaml": "runtime-endpoint: unix:///run/containerd/containerd.sock\n",
    "usr/local/bin/entrypoint": """\
#!/bin/bash
# Ready a privileged container to run systemd, containerd and a kubelet, then become init.
set -euo pipefail

# Mounts made by the kubelet (volumes) must propagate to the pods' containers.
mount --make-rshared /

if [[ ! -f /sys/fs/cgroup/cgroup.controllers ]]; then
  # cgroup v1 in a private cgroup namespace: our cgroups appear as each hierarchy's root.
  # The kubelet runs pods under /kubelet (kind's cgroupRoot); keep that group from being
  # removed by systemd with a bind mount of it onto itself. No misc controller: runc on v1
  # does not know it.
  if [[ -d /sys/fs/cgroup/misc ]]; then
    umount /sys/fs/cgroup/misc || true
    rmdir /sys/fs/cgroup/misc || true
    grep -v misc /proc/cgroups > /kind/cgroups
    mount --bind /kind/cgroups /proc/cgroups
  fi
  mount --make-rprivate /sys/fs/cgroup
  for hierarchy in /sys/fs/cgroup/*/; do
    [[ -L ${hierarchy%/} ]] && continue
    for root in kubelet kubelet.slice; do
      mkdir -p "$hierarchy$root"
      if [[ -f ${hierarchy}cpuset.cpus ]]; then
        cat "${hierarchy}cpuset.cpus" > "$hierarchy$root/cpuset.cpus"
        cat "${hierarchy}cpuset.mems" > "$hierarchy$root/cpuset.mems"
      fi
      mount --bind "$hierarchy$root" "$hierarchy$root"
    done
  done
fi

# A machine id of its own: the kubelet tells nodes apart by it.
rm -f /etc/machine-id
systemd-machine-id-setup

exec "$@"
""",
}

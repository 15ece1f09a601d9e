"""Build the control plane's binaries from Go modules, once, into a cache outside the clone.

There is no container runtime and no release download on the machines this runs
on, so kube-apiserver, kube-controller-manager, etcd and helm are compiled from
the Go module proxy. `k8s.io/kubernetes` maps its staging modules with
``replace => ./staging/...`` lines, which Go ignores in a dependency; a small
wrapper module repeats them as ``replace k8s.io/x => k8s.io/x v0.N.P``. KEDA's operator
(for tests/test_keda.py) is built the same way, repeating the replaces of KEDA's go.mod.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

KUBERNETES_VERSION = "v1.35.4"
HELM_VERSION = "v3.22.0"
KEDA_VERSION = "v2.21.0"
KEDA_MODULE = "github.com/kedacore/keda/v2"

_STAGING_REPLACE = re.compile(r"^\s*(k8s\.io/[\w.-]+)\s+=>\s+\./staging/", re.MULTILINE)
_ETCD_REQUIRE = re.compile(r"^\s*go\.etcd\.io/etcd/server/v3\s+(v[\w.+-]+)", re.MULTILINE)


def cache_root() -> Path:
    """Where binaries live: shared by every clone of the project on this machine."""
    env = os.environ.get("TASKLEASE_BIN_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tasklease"


@dataclass(frozen=True)
class Binaries:
    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path


def kubernetes_bin_dir(version: str = KUBERNETES_VERSION) -> Path:
    return cache_root() / f"kubernetes-{version}" / "bin"


def ensure_kubernetes(version: str = KUBERNETES_VERSION) -> Binaries:
    bin_dir = kubernetes_bin_dir(version)
    wanted = Binaries(
        etcd=bin_dir / "etcd",
        kube_apiserver=bin_dir / "kube-apiserver",
        kube_controller_manager=bin_dir / "kube-controller-manager",
    )
    if all(p.exists() for p in (wanted.etcd, wanted.kube_apiserver, wanted.kube_controller_manager)):
        return wanted
    _build_kubernetes(version, bin_dir)
    return wanted


@dataclass(frozen=True)
class NodeBinaries:
    kubelet: Path
    kube_scheduler: Path


def ensure_node_binaries(version: str = KUBERNETES_VERSION) -> NodeBinaries:
    """kubelet and kube-scheduler, built like the control plane into the same cache dir (`make node`)."""
    bin_dir = kubernetes_bin_dir(version)
    wanted = NodeBinaries(kubelet=bin_dir / "kubelet", kube_scheduler=bin_dir / "kube-scheduler")
    if not (wanted.kubelet.exists() and wanted.kube_scheduler.exists()):
        _build_kubernetes(version, bin_dir, commands=["kubelet", "kube-scheduler"], with_etcd=False)
    return wanted


def ensure_helm(version: str = HELM_VERSION) -> Path:
    found = shutil.which("helm")
    if found:
        return Path(found)
    target = cache_root() / f"helm-{version}" / "bin" / "helm"
    if not target.exists():
        _go_build(
            module=f"helm.sh/helm/v3 {version}",
            packages=[f"helm.sh/helm/v3/cmd/helm@{version}"],
            replaces=[],
            ldflags=f"-s -w -X helm.sh/helm/v3/internal/version.version={version}",
            out_dir=target.parent,
            label=f"helm {version}",
        )
    return target


def keda_module_dir(version: str = KEDA_VERSION) -> Path:
    """KEDA's module in the Go module cache (its CRDs are in config/crd/bases)."""
    return Path(_go_mod_download(f"{KEDA_MODULE}@{version}")["Dir"])


def ensure_keda(version: str = KEDA_VERSION) -> Path:
    """KEDA's operator (cmd/operator), which scales a workload between zero and one replica itself."""
    target = cache_root() / f"keda-{version}" / "bin" / "keda-operator"
    if not target.exists():
        gomod = (keda_module_dir(version) / "go.mod").read_text()
        _go_build(
            module=f"{KEDA_MODULE} {version}",
            packages=[f"{KEDA_MODULE}/cmd/operator@{version}"],
            replaces=module_replaces(gomod),
            ldflags=f"-s -w -X {KEDA_MODULE}/version.Version={version.removeprefix('v')}",
            out_dir=target.parent,
            label=f"the KEDA operator {version}",
            renames={"operator": "keda-operator"},
        )
    return target


def module_replaces(gomod: str) -> list[str]:
    """A go.mod's replace directives to other module versions (not to local folders): Go
    ignores them in a dependency, so the wrapper module repeats them."""
    found: list[str] = []
    in_block = False
    for raw in gomod.splitlines():
        line = raw.split("//")[0].strip()
        if line == "replace (":
            in_block = True
        elif in_block and line == ")":
            in_block = False
        elif in_block or line.startswith("replace "):
            body = line.removeprefix("replace ").strip()
            if "=>" in body and not body.split("=>")[1].strip().startswith(("./", "../", "/")):
                found.append(body)
    return found


def ensure_kubectl() -> Path:
    """The machine's kubectl when present; otherwise the one the `kubectl` wheel ships."""
    found = shutil.which("kubectl")
    if found:
        return Path(found)
    venv_bin = Path(sys.executable).parent
    candidate = venv_bin / "kubectl"
    if not candidate.exists():
        _log("kubectl not found: installing it from PyPI (the `kubectl` wheel)")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "kubectl"], check=True)
    if not candidate.exists():
        raise RuntimeError("kubectl is not on PATH and the `kubectl` wheel did not provide one")
    return candidate


def _kubernetes_gomod(version: str) -> str:
    return Path(_go_mod_download(f"k8s.io/kubernetes@{version}")["GoMod"]).read_text()


def _go_mod_download(module: str) -> dict[str, str]:
    if shutil.which("go") is None:
        raise RuntimeError(f"fetching {module} needs the Go toolchain (`go`) on PATH")
    out = subprocess.run(["go", "mod", "download", "-json", module], capture_output=True, text=True, env=_go_env(),
                         cwd="/")
    if out.returncode != 0:
        raise RuntimeError(f"cannot download {module} from the Go module proxy: {out.stdout}{out.stderr}".strip())
    found: dict[str, str] = json.loads(out.stdout)
    return found


def _build_kubernetes(
    version: str,
    bin_dir: Path,
    commands: tuple[str, ...] | list[str] = ("kube-apiserver", "kube-controller-manager"),
    with_etcd: bool = True,
) -> None:
    staging_version = "v0." + version.removeprefix("v1.")
    gomod = _kubernetes_gomod(version)
    replaces = [f"{m} => {m} {staging_version}" for m in sorted(set(_STAGING_REPLACE.findall(gomod)))]
    etcd = _ETCD_REQUIRE.search(gomod)
    if etcd is None:
        raise RuntimeError(f"k8s.io/kubernetes {version} does not name the etcd server it is tested with")
    major, minor = version.removeprefix("v").split(".")[:2]
    ldflags = " ".join([
        "-s -w",
        f"-X k8s.io/component-base/version.gitVersion={version}",
        f"-X k8s.io/component-base/version.gitMajor={major}",
        f"-X k8s.io/component-base/version.gitMinor={minor}",
        "-X k8s.io/component-base/version.gitTreeState=clean",
    ])
    packages = [f"k8s.io/kubernetes/cmd/{command}@{version}" for command in commands]
    if with_etcd:
        # etcd's server module is its main package; taking the version
        # kubernetes itself requires keeps the pair one tested combination.
        packages.append(f"go.etcd.io/etcd/server/v3@{etcd.group(1)}")
    _go_build(
        module=f"k8s.io/kubernetes {version}",
        packages=packages,
        replaces=replaces,
        ldflags=ldflags,
        out_dir=bin_dir,
        label=f"{', '.join(commands)}{' and etcd' if with_etcd else ''} for Kubernetes {version}",
        renames={"server": "etcd"},
    )


def _go_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("CGO_ENABLED", "0")
    env["GOFLAGS"] = "-mod=mod"
    return env


def _go_build(
    *,
    module: str,
    packages: list[str],
    replaces: list[str],
    ldflags: str,
    out_dir: Path,
    label: str,
    renames: dict[str, str] | None = None,
) -> None:
    if shutil.which("go") is None:
        raise RuntimeError(f"building {label} needs the Go toolchain (`go`) on PATH")
    _log(f"building {label} from the Go module proxy (first time only; several minutes)...")
    out_dir.mkdir(parents=True, exist_ok=True)
    env = _go_env()
    with tempfile.TemporaryDirectory(prefix="tasklease-gobuild-") as tmp:
        work = Path(tmp)
        gomod = ["module tasklease.local/build", "", "go 1.25.0", "", f"require {module}", ""]
        gomod += [f"replace {r}" for r in replaces]
        (work / "go.mod").write_text("\n".join(gomod) + "\n")
        staging = work / "out"
        staging.mkdir()
        subprocess.run(["go", "get", *packages], cwd=work, check=True, env=env)
        subprocess.run(
            ["go", "build", "-trimpath", f"-ldflags={ldflags}", "-o", str(staging) + "/",
             *[p.split("@")[0] for p in packages]],
            cwd=work, check=True, env=env,
        )
        # Move into place only when every binary built, so a half build never looks cached.
        for built in staging.iterdir():
            name = (renames or {}).get(built.name, built.name)
            shutil.move(str(built), out_dir / name)
    _log(f"built {label} into {out_dir}")


def _log(message: str) -> None:
    print(f"tasklease: {message}", file=sys.stderr, flush=True)

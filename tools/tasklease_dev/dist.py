"""`make dist`: every artifact of a release into dist/, with the one version pyproject.toml holds.

The wheel and the sdist (`python -m build`), the chart (`helm package`, its version and
appVersion the release's), the image as an OCI archive (buildah, from the Dockerfile), the
`kubectl tasklease` plugin archive with its krew manifest, and SHA256SUMS over all of them.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib
from pathlib import Path
from typing import Any

import yaml

from tasklease_dev import binaries, images

ROOT = Path(__file__).resolve().parents[2]
SOURCE_URL = "https://github.com/tasklease/tasklease"
IMAGE = "docker.io/library/tasklease"  # what the chart's default `image.repository: tasklease` means
PLUGIN = "kubectl-tasklease"
# The krew plugin runs the installed CLI; krew installs files, not Python packages.
_LAUNCHER = """#!/bin/sh
# kubectl tasklease: the tasklease CLI as a kubectl plugin (needs `pip install tasklease`).
command -v tasklease >/dev/null 2>&1 && exec tasklease "$@"
exec python3 -m tasklease.cli "$@" 2>/dev/null || {
  echo "kubectl tasklease: the tasklease CLI is not installed: pip install tasklease" >&2; exit 7; }
"""


def version(root: Path = ROOT) -> str:
    return str(tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"])


def plugin_archive(release: str, out: Path, root: Path = ROOT) -> Path:
    """The krew plugin's archive: the launcher and the license, with fixed times and owners."""
    archive = out / f"{PLUGIN}-{release}.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, data, mode in ((PLUGIN, _LAUNCHER.encode(), 0o755),
                                 ("LICENSE", (root / "LICENSE").read_bytes(), 0o644)):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), mode, 0
            tar.addfile(info, io.BytesIO(data))
    return archive


def krew_manifest(release: str, sha256: str) -> dict[str, Any]:
    """The krew `Plugin` for `kubectl tasklease`, pointing at the release's plugin archive."""
    uri = f"{SOURCE_URL}/releases/download/v{release}/{PLUGIN}-{release}.tar.gz"
    return {
        "apiVersion": "krew.googlecontainertools.github.com/v1alpha2",
        "kind": "Plugin",
        "metadata": {"name": "tasklease"},
        "spec": {
            "version": f"v{release}",
            "homepage": SOURCE_URL,
            "shortDescription": "Claim, run and manage tasklease Tasks",
            "description": "The tasklease CLI as a kubectl plugin: submit, list and follow Tasks\n"
                           "(tasklease.dev), claim them as an agent, or run a command per task\n"
                           "with `kubectl tasklease run --queue Q -- CMD`.\n",
            "caveats": "The plugin runs the tasklease CLI, a Python package. Install it first:\n"
                       "  pip install tasklease\n",
            "platforms": [{
                "selector": {"matchExpressions": [{"key": "os", "operator": "In", "values": ["linux", "darwin"]}]},
                "uri": uri,
                "sha256": sha256,
                "files": [{"from": PLUGIN, "to": "."}, {"from": "LICENSE", "to": "."}],
                "bin": PLUGIN,
            }],
        },
    }


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def revision(root: Path = ROOT, *, short: bool = False) -> str:
    """The commit checked out, `-dirty` when tracked files differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True).stdout.strip()
    commit = git("rev-parse", *(["--short=12"] if short else []), "HEAD") or "unknown"
    return f"{commit}-dirty" if git("status", "--porcelain", "--untracked-files=no") else commit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tasklease_dev.dist", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "dist", help="where the artifacts go (emptied first)")
    parser.add_argument("--no-image", action="store_true", help="leave the image out (no buildah here)")
    args = parser.parse_args(argv)
    release, out = version(), args.out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", str(out), str(ROOT)],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run([str(binaries.ensure_helm()), "package", str(ROOT / "helm" / "tasklease"), "--version", release,
                    "--app-version", release, "--destination", str(out)], check=True, stdout=subprocess.DEVNULL)
    if not args.no_image:
        labels = {"VERSION": release, "REVISION": revision(), "SOURCE": SOURCE_URL,
                  "CREATED": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        archive = out / f"tasklease-image-{release}.oci.tar"
        if shutil.which("buildah"):
            images.build_release_image(ROOT, f"{IMAGE}:{release}", archive, labels=labels)
        else:  # Docker: the same Dockerfile; `docker save` writes an OCI layout from Docker 25 on
            docker = shutil.which("docker") or "docker"
            subprocess.run([docker, "build", "-t", f"{IMAGE}:{release}",
                            *(f"--build-arg={key}={value}" for key, value in labels.items()), str(ROOT)], check=True)
            subprocess.run([docker, "save", "-o", str(archive), f"{IMAGE}:{release}"], check=True)
    plugin = plugin_archive(release, out)
    (out / "tasklease.krew.yaml").write_text(yaml.safe_dump(krew_manifest(release, _sha256(plugin)), sort_keys=False))
    sums = [f"{_sha256(path)}  {path.name}" for path in sorted(out.iterdir()) if path.is_file()]
    (out / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    print("\n".join(sorted(path.name for path in out.iterdir())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Container images without a registry: pause from C, a debootstrap'd Debian base, the Dockerfile.

No registry is reachable from the machines this runs on, so `make node` makes every
image it needs and caches it under the binary cache (``images/``): a static build of
the pause container, a Debian rootfs from debootstrap turned into a base image with
buildah, and the project's own Dockerfile built on that base. Each is kept as a
docker-archive tarball, keyed by what it is built from, for `ctr images import`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tasklease_dev.binaries import cache_root

PAUSE_IMAGE = "localhost/tasklease/pause:3.10"
BASE_IMAGE = "localhost/tasklease/debian-python:bookworm"
# What the chart and examples/agent-deployment.yaml name (`tasklease:dev`), normalised.
PROJECT_IMAGE = "docker.io/library/tasklease:dev"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
# The base with the image's pinned dependencies installed (`ensure_dependencies`), as the
# Dockerfile's build stage would install them.
DEPENDENCIES_IMAGE = "localhost/tasklease/dependencies"
_DEPENDENCIES_RECIPE = ("python3 -m venv /opt/tasklease && /opt/tasklease/bin/pip install --no-cache-dir "
                        "--disable-pip-version-check -r /tmp/constraints.txt && rm /tmp/constraints.txt")
_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"

# The pause container: sleep until told to stop, and reap children (the sandbox's PID 1).
_PAUSE_C = r"""
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>
static void stop(int sig) { (void)sig; _exit(0); }
static void reap(int sig) { (void)sig; while (waitpid(-1, NULL, WNOHANG) > 0) {} }
int main(void) {
  struct sigaction s = {0}, r = {0};
  s.sa_handler = stop; sigaction(SIGINT, &s, NULL); sigaction(SIGTERM, &s, NULL);
  r.sa_handler = reap; r.sa_flags = SA_NOCLDSTOP; sigaction(SIGCHLD, &r, NULL);
  for (;;) pause();
}
"""

# Enough to build and run the project: pip comes from the venv module's bundled wheel.
_DEBOOTSTRAP_PACKAGES = "python3,python3-venv,ca-certificates"


def images_dir() -> Path:
    return cache_root() / "images"


def ensure_pause() -> Path:
    """The pause image as a docker-archive (built once: gcc -static, then buildah)."""
    archive = images_dir() / "pause-3.10.tar"
    if archive.exists():
        return archive
    with tempfile.TemporaryDirectory(prefix="tasklease-pause-") as tmp:
        work = Path(tmp)
        (work / "pause.c").write_text(_PAUSE_C)
        _run(["gcc", "-Os", "-static", "-o", str(work / "pause"), str(work / "pause.c")])
        container = _buildah_out("from", "scratch")
        try:
            _buildah("copy", container, str(work / "pause"), "/pause")
            _buildah("config", "--entrypoint", '["/pause"]', "--user", "65535:65535", container)
            _buildah("commit", "-q", container, PAUSE_IMAGE)
        finally:
            _buildah("rm", container)
    return _archive(PAUSE_IMAGE, archive)


def ensure_base() -> str:
    """The Debian base image in buildah's store (debootstrap once, cached as a rootfs tarball)."""
    if _buildah_ok("inspect", "--type", "image", BASE_IMAGE):
        return BASE_IMAGE
    rootfs_tar = images_dir() / "debian-bookworm-python-rootfs.tar"
    if not rootfs_tar.exists():
        _log("debootstrapping a Debian bookworm rootfs with python3 (first time only; about 2 minutes)...")
        with tempfile.TemporaryDirectory(prefix="tasklease-rootfs-") as tmp:
            rootfs = Path(tmp) / "rootfs"
            _run(["debootstrap", "--variant=minbase", f"--include={_DEBOOTSTRAP_PACKAGES}",
                  "bookworm", str(rootfs), DEBIAN_MIRROR])
            # Smaller, and pip may install into the image's own venvs like on python:3.11-slim.
            for junk in ("usr/share/doc", "usr/share/man", "usr/share/locale", "var/lib/apt/lists",
                         "var/cache/apt", "usr/lib/python3.11/EXTERNALLY-MANAGED"):
                target = rootfs / junk
                if target.is_dir():
                    shutil.rmtree(target)
                elif target.exists():
                    target.unlink()
            partial = rootfs_tar.with_suffix(".partial")
            _run(["tar", "-C", str(rootfs), "--numeric-owner", "-cf", str(partial), "."])
            partial.rename(rootfs_tar)
    container = _buildah_out("from", "scratch")
    try:
        _buildah("add", container, str(rootfs_tar), "/")
        _buildah("config", "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                 "--env", "LANG=C.UTF-8", "--cmd", '["python3"]', container)
        _buildah("commit", "-q", container, BASE_IMAGE)
    finally:
        _buildah("rm", container)
    return BASE_IMAGE


def project_archive(source: Path) -> Path:
    """Where the project image built from ``source`` as it is now is cached."""
    return images_dir() / f"tasklease-{_source_digest(source)}.tar"


def ensure_project_image(source: Path) -> Path:
    """The project's image, built from its own Dockerfile on the Debian base, as a docker-archive."""
    archive = project_archive(source)
    if archive.exists():
        return archive
    _log("building the project image from the Dockerfile with buildah...")
    _bud(source, PROJECT_IMAGE, ensure_base())
    for stale in images_dir().glob("tasklease-*.tar"):
        stale.unlink()
    return _archive(PROJECT_IMAGE, archive)


def build_release_image(source: Path, image: str, archive: Path, *, labels: dict[str, str]) -> Path:
    """The project's image for a release, as an OCI archive: the Dockerfile on `base` (the
    Debian base unless $DIST_BASE_IMAGE names another in buildah's store), its labels'
    build arguments set."""
    base = os.environ.get("DIST_BASE_IMAGE") or ensure_base()
    _log(f"building {image} from the Dockerfile with buildah on {base}...")
    _bud(source, image, base, *(f"--build-arg={key}={value}" for key, value in labels.items()))
    archive.unlink(missing_ok=True)
    _buildah("push", "-q", image, f"oci-archive:{archive}:{image}")
    return archive


def ensure_dependencies(source: Path, base: str) -> str:
    """`base` with a venv in /opt/tasklease holding the packages `source`'s constraints.txt
    pins: the Dockerfile's build stage starts from it (`BUILD_BASE`) and then installs the
    project alone. Kept in buildah's store, named after the base image and the pins; made again
    when either changes, and the one it replaces is removed."""
    constraints = (source / "constraints.txt").read_bytes()
    base_id = _buildah_out("inspect", "--type", "image", "--format", "{{.FromImageID}}", base)
    key = hashlib.sha256(b"\0".join([_DEPENDENCIES_RECIPE.encode(), base_id.encode(), constraints]))
    image = f"{DEPENDENCIES_IMAGE}:{key.hexdigest()[:16]}"
    if _buildah_ok("inspect", "--type", "image", image):
        return image
    _log("installing the image's pinned dependencies (once per base and constraints.txt)...")
    container = _buildah_out("from", "--pull=never", base)
    try:
        _buildah("copy", container, str(source / "constraints.txt"), "/tmp/constraints.txt")
        _buildah("run", "--network", "host", *_ca_mount(), *(f"--env={k}={v}" for k, v in _pip_settings()),
                 container, "--", "sh", "-c", _DEPENDENCIES_RECIPE)
        _buildah("commit", "-q", "--rm", container, image)
    except BaseException:
        _buildah_ok("rm", container)
        raise
    for stale in _buildah_out("images", "--noheading", "--format", "{{.Name}}:{{.Tag}}").split():
        if stale.startswith(f"{DEPENDENCIES_IMAGE}:") and stale != image:
            _buildah_ok("rmi", stale)
    return image


def _ca_mount() -> list[str]:
    """The host's CA bundle, for a step that runs pip: PyPI may be reached through an
    egress proxy whose CA only the host's bundle has."""
    return ["-v", f"{_CA_BUNDLE}:{_CA_BUNDLE}:ro"] if Path(_CA_BUNDLE).exists() else []


def _pip_settings() -> list[tuple[str, str]]:
    """What pip needs from the host's environment inside a build step: its proxies, its index,
    and the CA bundle `_ca_mount` brings."""
    found = [(k, v) for k, v in os.environ.items()
             if k.lower() in ("http_proxy", "https_proxy", "no_proxy", "pip_index_url")]
    return found + ([("PIP_CERT", _CA_BUNDLE)] if _ca_mount() else [])


def _bud(source: Path, image: str, base: str, *build_args: str) -> None:
    """`buildah bud` of the project's Dockerfile on `base`, tagged `image`, its build stage
    started from `ensure_dependencies`; then the images left without a name (the one `image`
    named before) go."""
    # PyPI is reached through the host's network (buildah's default RUN network is a bridge).
    _buildah("bud", "-q", "--pull=never", "--network", "host", "--layers=false",
             f"--build-arg=BASE_IMAGE={base}", f"--build-arg=BUILD_BASE={ensure_dependencies(source, base)}",
             *(f"--build-arg={k}={v}" for k, v in _pip_settings()), *_ca_mount(), *build_args,
             "-t", image, "-f", str(source / "Dockerfile"), str(source))
    _buildah_ok("rmi", "--prune")


def buildah_store() -> list[str]:
    """buildah's flags for the project's private image store (nothing in /var/lib/containers)."""
    store = images_dir() / "buildah"
    return ["--root", str(store / "root"), "--runroot", str(store / "run"), "--storage-driver", "overlay"]


def _source_digest(source: Path) -> str:
    """What the image is built from: the Dockerfile, the files it copies and operator/."""
    digest = hashlib.sha256()
    files = [source / name for name in ("Dockerfile", "pyproject.toml", "README.md", "LICENSE", "constraints.txt")]
    files += sorted(p for p in (source / "operator").rglob("*")
                    if p.is_file() and "__pycache__" not in p.parts and ".egg-info" not in str(p))
    for path in files:
        digest.update(str(path.relative_to(source)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _archive(image: str, archive: Path) -> Path:
    archive.parent.mkdir(parents=True, exist_ok=True)
    partial = archive.with_suffix(".partial")
    partial.unlink(missing_ok=True)
    _buildah("push", "-q", image, f"docker-archive:{partial}:{image}")
    partial.rename(archive)
    return archive


# What buildah creates outside its store whatever its flags say (CNI's lock even with
# --network host, runc's default root, the blob-info cache); removed when buildah made them.
_BUILDAH_LEAKS = (Path("/etc/cni"), Path("/run/runc"), Path("/var/lib/containers"))


def _buildah(*args: str) -> None:
    _buildah_out(*args)


def _buildah_out(*args: str) -> str:
    fresh = [p for p in _BUILDAH_LEAKS if not p.exists()]
    try:
        return _run(["buildah", *buildah_store(), *args], capture=True).strip()
    finally:
        for leak in fresh:
            shutil.rmtree(leak, ignore_errors=True)


def _buildah_ok(*args: str) -> bool:
    try:
        _buildah_out(*args)
    except RuntimeError:
        return False
    return True


def _run(argv: list[str], *, capture: bool = False) -> str:
    done = subprocess.run(argv, text=True, capture_output=capture)
    if done.returncode != 0:
        detail = f": {done.stderr.strip()[-800:]}" if capture and done.stderr else ""
        raise RuntimeError(f"`{' '.join(argv[:6])} ...` failed (exit {done.returncode}){detail}")
    return done.stdout if capture else ""


def _log(message: str) -> None:
    print(f"tasklease: {message}", file=sys.stderr, flush=True)

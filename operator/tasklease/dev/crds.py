"""Apply the project's CRDs to a cluster and wait until the API server serves them."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tasklease.dev.binaries import ensure_kubectl


def apply_crds(*, kubeconfig: Path, folder: Path, timeout_s: int = 60) -> None:
    kubectl = [str(ensure_kubectl()), f"--kubeconfig={kubeconfig}"]
    subprocess.run([*kubectl, "apply", "--server-side", "--force-conflicts", "-f", str(folder)],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run([*kubectl, "wait", "--for=condition=Established", f"--timeout={timeout_s}s",
                    "-f", str(folder)], check=True, stdout=subprocess.DEVNULL)

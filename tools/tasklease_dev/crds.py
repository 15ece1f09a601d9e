"""Apply the project's CRDs to a cluster and wait until the API server serves them."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from tasklease.api import resource
from tasklease_dev.binaries import ensure_kubectl


def apply_crds(*, kubeconfig: Path, folder: Path, timeout_s: int = 60) -> None:
    kubectl = [str(ensure_kubectl()), f"--kubeconfig={kubeconfig}"]
    subprocess.run([*kubectl, "apply", "--server-side", "--force-conflicts", "-f", str(folder)],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run([*kubectl, "wait", "--for=condition=Established", f"--timeout={timeout_s}s",
                    "-f", str(folder)], check=True, stdout=subprocess.DEVNULL)
    # Established comes a moment before the storage serves: until then a LIST answers
    # 429 "storage is (re)initializing".
    deadline = time.monotonic() + timeout_s
    listing = [*kubectl, "get", f"{resource.PLURAL}.{resource.GROUP}", "-A", "--request-timeout=5s"]
    while subprocess.run(listing, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode != 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the API server does not serve {resource.PLURAL}.{resource.GROUP} after {timeout_s}s")
        time.sleep(0.2)

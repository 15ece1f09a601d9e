"""`tasklease_build_info`: one series at 1, saying which tasklease, Python, kopf and
Kubernetes client run."""

from __future__ import annotations

import platform
from importlib import metadata

from tasklease.api.build import version
from tasklease.operator import metrics


def test_build_info_names_the_versions_that_run() -> None:
    samples = [s for family in metrics.REGISTRY.collect() for s in family.samples if s.name == "tasklease_build_info"]
    assert len(samples) == 1 and samples[0].value == 1
    assert samples[0].labels == {"version": version(), "python": platform.python_version(),
                                 "kopf": metadata.version("kopf"), "kubernetes_client": metadata.version("kubernetes")}
    assert version() == metadata.version("tasklease")

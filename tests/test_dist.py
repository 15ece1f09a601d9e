"""A release as users get it: the wheel alone in a fresh virtualenv, one version everywhere,
and the krew manifest. `make dist` builds the same artifacts (tools/tasklease_dev/dist.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import yaml

from conftest import ROOT
from tasklease_dev import dist


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(ROOT)],
                   check=True, capture_output=True, timeout=600)
    (found,) = out.glob("tasklease-*.whl")
    return found


def test_the_wheel_ships_the_package_and_its_license_not_the_tools(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert "tasklease/agent/__init__.py" in names and "tasklease/py.typed" in names
    assert not [n for n in names if n.startswith(("tasklease_dev", "tasklease/dev/", "tests/"))]
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    metadata = zipfile.ZipFile(wheel).read(f"tasklease-{dist.version()}.dist-info/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata and "Project-URL: Source, " in metadata
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    base = [r for r in requires if "extra ==" not in r]
    assert not [r for r in base if re.search(r"kopf|prometheus", r)], base
    assert [r for r in requires if "kopf" in r and 'extra == "operator"' in r], requires


def test_the_wheel_alone_in_a_fresh_virtualenv_gives_the_cli_and_the_sdk(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-compile", "--disable-pip-version-check",
                    str(wheel)], check=True, capture_output=True, timeout=600)
    away = tmp_path / "elsewhere"  # no source tree within reach
    away.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}

    def run(*cmd: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(cmd, cwd=away, env=env, capture_output=True, text=True, timeout=120)

    version = run(str(venv / "bin" / "tasklease"), "--version")
    assert version.returncode == 0 and dist.version() in version.stdout, version
    helped = run(str(venv / "bin" / "tasklease"), "--help")
    assert helped.returncode == 0 and "claim" in helped.stdout and "run" in helped.stdout, helped
    probe = ("import importlib.util, tasklease\nfrom tasklease.agent import Agent\n"
             "print(Agent.__name__, tasklease.__file__, [m for m in ('kopf', 'prometheus_client', 'tasklease_dev')"
             " if importlib.util.find_spec(m)])")
    imported = run(str(venv / "bin" / "python"), "-c", probe)
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.startswith(f"Agent {venv}") and imported.stdout.rstrip().endswith("[]"), imported.stdout
    operator = run(str(venv / "bin" / "tasklease"), "operator")
    assert operator.returncode == 1 and operator.stderr.strip().count("\n") == 0, operator.stderr
    assert "pip install 'tasklease[operator]'" in operator.stderr


def test_the_chart_and_the_image_take_the_version_from_pyproject() -> None:
    chart = yaml.safe_load((ROOT / "helm" / "tasklease" / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == dist.version()
    assert chart["kubeVersion"] == ">=1.32.0-0"
    assert f"ARG VERSION={dist.version()}" in (ROOT / "Dockerfile").read_text()
    assert f"## [{dist.version()}]" in (ROOT / "CHANGELOG.md").read_text()


def test_the_krew_manifest_installs_the_plugin_archive(tmp_path: Path) -> None:
    archive = dist.plugin_archive("1.2.3", tmp_path)
    manifest = dist.krew_manifest("1.2.3", dist._sha256(archive))
    assert manifest["apiVersion"] == "krew.googlecontainertools.github.com/v1alpha2" and manifest["kind"] == "Plugin"
    spec = manifest["spec"]
    assert spec["version"] == "v1.2.3" and spec["shortDescription"] and "pip install tasklease" in spec["caveats"]
    assert len(spec["shortDescription"]) <= 50
    (platform,) = spec["platforms"]
    assert re.fullmatch(r"[0-9a-f]{64}", platform["sha256"])
    assert platform["uri"].endswith("/kubectl-tasklease-1.2.3.tar.gz")
    assert "/v1.2.3/" in platform["uri"] and platform["uri"].startswith("https://")
    with tarfile.open(archive) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert {f["from"] for f in platform["files"]} <= set(members)
        assert members[platform["bin"]].mode & 0o111
        launcher = tar.extractfile(platform["bin"]).read().decode()  # type: ignore[union-attr]
    assert launcher.startswith("#!/bin/sh") and 'exec tasklease "$@"' in launcher
    assert yaml.safe_load(yaml.safe_dump(manifest)) == manifest

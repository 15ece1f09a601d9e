"""`python -m tasklease_dev.unitvenv 3.12.1`: the virtualenv `make unit-all` runs the unit tests in on that Python.

It holds the dependencies only (tasklease's, the `operator` extra's, and the test runner's),
and lives outside the clone beside the binaries (`binaries.cache_root`): made once per Python
and set of requirements, then shared by every clone on the machine. The tests import
tasklease and tasklease_dev from the clone's source folders (`PYTHONPATH`), so no clone
installs itself into a virtualenv that another one uses. Prints the virtualenv's path.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from tasklease_dev.binaries import cache_root

ROOT = Path(__file__).resolve().parents[2]
EXTRAS = ("operator",)
RUNNERS = ("pytest", "pytest-timeout", "hypothesis")  # of the `test` extra: what the unit tests run with
_READY = ".ready"


def requirements(pyproject: Path) -> list[str]:
    """What the unit tests need installed, as `pyproject` states it."""
    project = tomllib.loads(pyproject.read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = [*project["dependencies"], *(r for extra in EXTRAS for r in extras[extra])]
    wanted += [r for r in extras["test"] if _name(r) in RUNNERS]
    return sorted(set(wanted))


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower()


def interpreter(version: str) -> Path:
    """pyenv's Python `version`."""
    return Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions" / version / "bin" / "python"


def location(version: str, wanted: list[str]) -> Path:
    """Where the virtualenv for Python `version` and the requirements `wanted` lives."""
    key = hashlib.sha256(json.dumps([version, wanted]).encode()).hexdigest()[:12]
    return cache_root() / "venvs" / f"python-{version}-{key}"


def ensure(version: str, pyproject: Path = ROOT / "pyproject.toml") -> Path:
    """The virtualenv at `location`, made if missing. A lock keeps two clones from making the
    same one at once; one left half made (its maker was killed) is made again."""
    wanted = requirements(pyproject)
    venv = location(version, wanted)
    if (venv / _READY).exists():
        return venv
    python = interpreter(version)
    if not python.exists():
        raise SystemExit(f"unitvenv: Python {version} is not installed at {python} (pyenv install {version})")
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (venv / _READY).exists():
            print(f"unitvenv: making {venv} (once per Python and set of requirements)", file=sys.stderr)
            shutil.rmtree(venv, ignore_errors=True)
            subprocess.run([str(python), "-m", "venv", str(venv)], check=True)
            subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *wanted], check=True)
            (venv / _READY).touch()
    return venv


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tasklease_dev.unitvenv", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("version", help="a Python version pyenv installed, such as 3.12.1")
    args = parser.parse_args(argv)
    print(ensure(args.version))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Prometheus and promtool for the monitoring tests: Debian's `prometheus` package
(`make prometheus` installs it), found on the PATH; the tests that need them skip, and say
how to get them, when they are not there."""

from __future__ import annotations

import shutil

import pytest


def need(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not on the PATH: `make prometheus` installs Debian's prometheus package")
    return found

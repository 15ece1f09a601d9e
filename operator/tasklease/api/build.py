"""Which tasklease this is: the installed distribution's version."""

from __future__ import annotations

from importlib import metadata


def version() -> str:
    try:
        return metadata.version("tasklease")
    except metadata.PackageNotFoundError:
        return "unknown"  # run from a source tree that was never installed

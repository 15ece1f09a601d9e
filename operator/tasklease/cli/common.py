"""What every `tasklease` command shares: the API client from the global flags, one-line messages."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tasklease.api import errors
from tasklease.kube import Kube


def kube_of(args: argparse.Namespace, *, pool_size: int = 16) -> Kube:
    return Kube.connect(kubeconfig=args.kubeconfig, context=args.context, namespace=args.namespace,
                        pool_size=pool_size)


def first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def read_text(path: str) -> str:
    """A file's text, or stdin's for "-"; what cannot be read is bad input (exit 9), said in one line."""
    try:
        if path != "-":
            return Path(path).read_text()
        if sys.stdin is None:
            raise errors.Invalid("cannot read - (stdin): it is closed")
        return sys.stdin.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise errors.Invalid(f"cannot read {path}: {first_line(str(exc))}") from None

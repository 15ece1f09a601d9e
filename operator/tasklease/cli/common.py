"""What every `tasklease` command shares: the API client from the global flags, one-line messages."""

from __future__ import annotations

import argparse

from tasklease.kube import Kube


def kube_of(args: argparse.Namespace) -> Kube:
    kube = Kube.connect(kubeconfig=args.kubeconfig, context=args.context, namespace=args.namespace)
    return kube


def first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""

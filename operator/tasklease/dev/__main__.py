"""`python -m tasklease.dev up|down|build|tools`: the Makefile's entry to the local control plane."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from tasklease.dev import binaries
from tasklease.dev.cluster import LocalCluster
from tasklease.dev.crds import apply_crds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tasklease.dev",
        description="Run a real kube-apiserver, etcd and kube-controller-manager on 127.0.0.1.",
    )
    parser.add_argument("--workdir", type=Path, default=Path(".cache/cluster"),
                        help="where data, certificates and logs live (default: .cache/cluster)")
    parser.add_argument("--kubeconfig", type=Path, default=Path(".cache/kubeconfig"),
                        help="where to write the admin kubeconfig (default: .cache/kubeconfig)")
    parser.add_argument("--crds", type=Path, default=Path("crds"), help="CRDs to apply (default: crds/)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("up", help="start the control plane (harmless when it already runs) and apply the CRDs")
    sub.add_parser("down", help="stop every process `up` started and remove the data")
    sub.add_parser("build", help="build (or find) etcd, kube-apiserver, kube-controller-manager, kubectl and helm")
    args = parser.parse_args(argv)

    cluster = LocalCluster(args.workdir, args.kubeconfig)
    if args.command == "build":
        bins = binaries.ensure_kubernetes()
        print(bins.kube_apiserver.parent)
        print(binaries.ensure_kubectl())
        print(binaries.ensure_helm())
        return 0
    if args.command == "down":
        cluster.down()
        print("tasklease: local control plane stopped", file=sys.stderr)
        return 0
    try:
        state = cluster.up()
        apply_crds(kubeconfig=Path(state.kubeconfig), folder=args.crds)
    except (subprocess.CalledProcessError, RuntimeError, TimeoutError) as exc:
        print(f"tasklease: local control plane: {exc}", file=sys.stderr)
        return 1
    print(f"export KUBECONFIG={state.kubeconfig}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

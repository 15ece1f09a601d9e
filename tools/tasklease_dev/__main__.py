"""`python -m tasklease_dev up|down|build|node-up|node-down|kind-build|kind-up|kind-down`: the Makefile's entry."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from tasklease_dev import binaries
from tasklease_dev.cluster import LocalCluster
from tasklease_dev.crds import apply_crds
from tasklease_dev.kind import KindCluster
from tasklease_dev.kind import prepare as kind_prepare
from tasklease_dev.node import LocalNode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tasklease_dev",
        description="Run a real kube-apiserver, etcd and kube-controller-manager on 127.0.0.1.",
    )
    parser.add_argument("--workdir", type=Path, default=Path(".cache/cluster"),
                        help="where data, certificates and logs live (default: .cache/cluster)")
    parser.add_argument("--kubeconfig", type=Path, default=Path(".cache/kubeconfig"),
                        help="where to write the admin kubeconfig (default: .cache/kubeconfig)")
    parser.add_argument("--crds", type=Path, default=Path("crds"), help="CRDs to apply (default: crds/)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("up", help="start the control plane (harmless when it already runs) and apply the CRDs")
    sub.add_parser("down", help="stop every process `up` started (and the node, if any) and remove the data")
    sub.add_parser("node-up", help="add a real node (containerd, kubelet, scheduler) to the control plane; root")
    sub.add_parser("node-down", help="remove the node and everything it changed on this machine; root")
    sub.add_parser("kind-up", help="a 2-node kind cluster from kind-config.yaml in a network namespace; root")
    sub.add_parser("kind-down", help="remove the kind cluster and everything it changed on this machine; root")
    sub.add_parser("kind-build", help="build what kind-up needs (components, base and project images); root")
    sub.add_parser("build", help="build (or find) etcd, kube-apiserver, kube-controller-manager, kubectl, helm, KEDA")
    args = parser.parse_args(argv)

    cluster = LocalCluster(args.workdir, args.kubeconfig)
    node = LocalNode(cluster, args.workdir.parent / "node", source=Path("."))
    if args.command in ("kind-up", "kind-down"):
        return _kind(KindCluster(args.workdir.parent / "kind", source=Path(".")), up=args.command == "kind-up")
    if args.command == "kind-build":
        kind_prepare(Path("."))
        return 0
    if args.command == "build":
        bins = binaries.ensure_kubernetes()
        print(bins.kube_apiserver.parent)
        print(binaries.ensure_kubectl())
        print(binaries.ensure_helm())
        print(binaries.ensure_keda())
        return 0
    if args.command in ("down", "node-down"):
        try:
            if args.command == "node-down" or node.workdir.exists():
                node.down()
        except (PermissionError, RuntimeError) as exc:
            print(f"tasklease: node: {exc}", file=sys.stderr)
            return 1
        if args.command == "node-down":
            print("tasklease: node removed", file=sys.stderr)
            return 0
        cluster.down()
        print("tasklease: local control plane stopped", file=sys.stderr)
        return 0
    try:
        if args.command == "node-up":
            # No crds/ here: the chart installs and owns the CRD on a node's cluster.
            node.up()
            state = cluster.up(node=True)
        else:
            state = cluster.up()
            apply_crds(kubeconfig=Path(state.kubeconfig), folder=args.crds)
    except (subprocess.CalledProcessError, RuntimeError, TimeoutError, PermissionError) as exc:
        print(f"tasklease: {'node' if args.command == 'node-up' else 'local control plane'}: {exc}",
              file=sys.stderr)
        return 1
    print(f"export KUBECONFIG={state.kubeconfig}")
    return 0


def _kind(kind: KindCluster, *, up: bool) -> int:
    try:
        if not up:
            kind.down()
            print("tasklease: kind cluster removed", file=sys.stderr)
            return 0
        state = kind.up()
    except (subprocess.CalledProcessError, RuntimeError, TimeoutError, PermissionError) as exc:
        print(f"tasklease: kind: {exc}", file=sys.stderr)
        return 1
    print(f"export KUBECONFIG={state.kubeconfig}  # reachable inside: ip netns exec tasklease-kind ...")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

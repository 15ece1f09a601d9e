"""`tasklease operator`: the kopf wiring around `reconciler.Reconciler`.

kopf choices, on purpose (see docs/operator.md):
- Only low-level `on.event` handlers: kopf stores no progress, adds no annotations and
  no finalizers (nothing blocks deleting a Task or a Lease while the operator is down).
- Leases and Pods are filtered by the API server (`settings.watching.label_selectors`):
  only Leases labelled `app.kubernetes.io/managed-by=tasklease`, only Pods labelled
  `tasklease.dev/agent=true`. Node heartbeats and other leader elections never arrive.
- Handlers are `async` and only update memory; API writes happen in worker threads
  with the synchronous client, never on kopf's event loop.
- kopf posts no Events of its own (`settings.posting.enabled = False`); the reconciler
  posts one per abnormal task transition (and per happy one with `--events=all`).
  Peering is off (`standalone`): HA is a Lease election.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import kopf
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tasklease.api import errors, models
from tasklease.operator import metrics
from tasklease.protocol import record
from tasklease.kube import Kube
from tasklease.operator.health import WatchHealth
from tasklease.operator.leader import ElectionConfig, LeaderElector
from tasklease.operator.reconciler import Reconciler

log = logging.getLogger("tasklease.operator")

AGENT_POD_SELECTOR = "tasklease.dev/agent=true"


def run_operator(args: argparse.Namespace) -> int:
    if args.all_namespaces and args.namespaces:
        raise errors.Invalid("--all-namespaces and --namespace exclude each other")
    kube = Kube.connect(kubeconfig=args.kubeconfig, context=args.context, pool_size=32)
    identity = f"{os.environ.get('POD_NAME') or socket.gethostname()}/{uuid.uuid4().hex[:8]}"
    reconciler = Reconciler(kube, grace_s=args.grace, namespaces=args.namespaces, workers=args.workers,
                            default_ttl_s=args.ttl_seconds_after_finished, coalesce_s=args.coalesce,
                            happy_events=args.events == "all")
    stop = threading.Event()
    ready = threading.Event()
    elector = None
    if args.leader_elect:
        duration = args.leader_election_lease_duration
        config = ElectionConfig(
            namespace=args.leader_election_namespace or os.environ.get("POD_NAMESPACE") or kube.namespace,
            lease_duration_s=duration, renew_deadline_s=duration * 2 / 3, retry_period_s=max(duration / 7.5, 0.2))
        elector = LeaderElector(kube, config, identity=identity, on_started=reconciler.activate,
                                on_stopped=reconciler.deactivate)
    health = WatchHealth()
    health.attach()
    server = _serve_http(args.http_host, args.http_port, reconciler, ready, health) if args.http_port else None
    workers = threading.Thread(target=reconciler.run, args=(stop,), name="reconciler", daemon=True)
    workers.start()
    if elector is not None:
        elector.start()
    else:
        reconciler.activate()
    log.info("operator %s starting (%s, leader election %s)", identity,
             "namespaces " + ",".join(args.namespaces) if args.namespaces else "all namespaces",
             "on" if elector else "off")
    try:
        _run_kopf(reconciler, kube, args, ready, identity, health)
    finally:
        stop.set()
        if elector is not None:
            elector.stop()
        if server is not None:
            server.shutdown()
    return 0


def _run_kopf(reconciler: Reconciler, kube: Kube, args: argparse.Namespace, ready: threading.Event,
              identity: str, health: WatchHealth) -> None:
    registry = _registry(reconciler, kube, health)
    # kopf logs every handler call at INFO; our own log has one line per task transition.
    for name in ("kopf.objects", "kopf.activities"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # Our identity, not kopf's default: that asks getpass.getuser(), which fails for a uid
    # without a passwd entry (the image's 65532).
    kopf.run(registry=registry, standalone=True, clusterwide=not args.namespaces,
             namespaces=args.namespaces or (), ready_flag=ready,
             identity=identity)  # type: ignore[arg-type]  # kopf.Identity is a NewType kopf does not export


def _registry(reconciler: Reconciler, kube: Kube, health: WatchHealth) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.watching.label_selectors["coordination.k8s.io", "leases"] = record.MANAGED_SELECTOR
        settings.watching.label_selectors["v1", "pods"] = AGENT_POD_SELECTOR
        settings.posting.enabled = False
        # Reconnect at least every 5 minutes; kopf's inactivity timeout (70 s, with
        # bookmarks) catches a silently dead stream sooner.
        settings.watching.server_timeout = 300
        settings.watching.client_timeout = 330

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return _connection_info(kube)

    @kopf.on.event(models.GROUP, models.VERSION, models.PLURAL, registry=registry)
    async def task_event(event: kopf.RawEvent, **_: Any) -> None:
        health.event()
        reconciler.on_task(event.get("type") or "ADDED", dict(event["object"]))

    @kopf.on.event("coordination.k8s.io", "v1", "leases", registry=registry)
    async def lease_event(event: kopf.RawEvent, **_: Any) -> None:
        health.event()
        reconciler.on_lease(event.get("type") or "ADDED", dict(event["object"]))

    @kopf.on.event("v1", "pods", registry=registry)
    async def pod_event(event: kopf.RawEvent, **_: Any) -> None:
        reconciler.on_pod(event.get("type") or "ADDED", dict(event["object"]))

    return registry


def _connection_info(kube: Kube) -> kopf.ConnectionInfo:
    """Hand kopf the exact credentials our own client uses (flag, kubeconfig or in-cluster)."""
    cfg = kube.api_client.configuration
    if cfg.refresh_api_key_hook is not None:
        cfg.refresh_api_key_hook(cfg)
    token = (cfg.api_key or {}).get("authorization", "") or (cfg.api_key or {}).get("BearerToken", "")
    scheme, _, value = token.partition(" ")
    return kopf.ConnectionInfo(
        server=cfg.host, ca_path=cfg.ssl_ca_cert, insecure=not cfg.verify_ssl,
        certificate_path=cfg.cert_file, private_key_path=cfg.key_file,
        scheme=scheme or None, token=value or None, default_namespace=kube.namespace)


def _serve_http(host: str, port: int, reconciler: Reconciler, ready: threading.Event,
                health: WatchHealth) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.path == "/metrics":
                self._reply(200, generate_latest(metrics.REGISTRY), CONTENT_TYPE_LATEST)
            elif self.path == "/healthz":
                self._reply(200, b"ok\n")
            elif self.path == "/readyz":
                # A leader is ready once it has reconciled every Task that existed when it
                # started leading (the initial backlog); a standby once its watches run. Either
                # is unready while a watch keeps failing.
                role = "leader" if reconciler.active.is_set() else "standby"
                problem = health.problem()
                if not ready.is_set() or (role == "leader" and not reconciler.caught_up.is_set()):
                    self._reply(503, f"starting {role}\n".encode())
                elif problem is not None:
                    self._reply(503, f"watch failing ({role}): {problem}\n".encode())
                else:
                    self._reply(200, f"ready {role}\n".encode())
            else:
                self._reply(404, b"not found: try /metrics, /healthz or /readyz\n")

        def _reply(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return  # probes every few seconds would drown the transition log

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    log.info("serving /metrics, /healthz and /readyz on %s:%d", host, server.server_address[1])
    return server

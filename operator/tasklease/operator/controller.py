"""`tasklease operator`: the kopf and watch wiring around `reconciler.Reconciler`.

Choices, on purpose (see docs/operator.md):
- Tasks and Leases, the two kinds that grow with the queue, are watched by our own
  `kube.watching.Reflector`s (paginated lists, nothing in their stores: the reconciler's
  store names what a relist must find again), not by
  kopf: kopf lists a kind in one answer and keeps every object it lists in a per-object
  worker until that worker has been idle for seconds, which costs memory per task (`make
  bench` measures the operator's memory at depth).
- kopf runs the rest: login, the Pod and CRD watches, signals, its lifecycle. Only
  low-level `on.event` handlers: kopf stores no progress, adds no annotations and no
  finalizers (nothing blocks deleting a Task or a Lease while the operator is down).
- Leases and Pods are filtered by the API server: only Leases labelled
  `app.kubernetes.io/managed-by=tasklease`, only Pods labelled `tasklease.dev/agent=true`.
  Node heartbeats and other leader elections never arrive.
- Handlers only update memory; API writes happen in worker threads with the synchronous
  client, never on kopf's event loop.
- kopf posts no Events of its own (`settings.posting.enabled = False`); the reconciler
  posts one per abnormal task transition (and per happy one with `--events=all`).
  Peering is off (`standalone`): HA is a Lease election.
- `health.Health` checks what kopf does not: our rights at start (readiness fails and says
  which are missing, rechecked until fixed), the reconciler and election threads
  (liveness), the watches (from kopf's and the Reflectors' logs), and the Task CRD's identity,
  from a watch of that one CRD: when it is deleted and recreated, every watch is restarted.
  A healthy idle operator makes no request but its watches.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import signal
import socket
import sys
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType
from typing import Any

import kopf
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tasklease.operator import logs, metrics
from tasklease.protocol import record
from tasklease.kube import JSON, LEASES, TASKS, Kube
from tasklease.kube.watching import Reflector
from tasklease.operator.health import CRD_NAME, Health, WatchHealth
from tasklease.operator.leader import ElectionConfig, LeaderElector
from tasklease.operator.options import validate
from tasklease.operator.podbound import PodBound
from tasklease.operator.queues import QueueController
from tasklease.operator.reconciler import Reconciler

log = logging.getLogger("tasklease.operator")

AGENT_POD_SELECTOR = "tasklease.dev/agent=true"
# The watches of Tasks and Leases are read a batch per wake-up (`Kube.watch`), each event at
# most this late: a busy queue brings a few events per task, and reconciles wait `--coalesce`.
_WATCH_BATCH_S = 0.1


def run_operator(args: argparse.Namespace) -> int:
    logs.use_format(args.log_format)
    validate(args)
    # Until kopf installs its own handler (and between its restarts) SIGTERM still means a
    # clean exit 0 through the `finally` below, not death by signal.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    kube = Kube.connect(kubeconfig=args.kubeconfig, context=args.context, pool_size=32)
    identity = f"{os.environ.get('POD_NAME') or socket.gethostname()}/{uuid.uuid4().hex[:8]}"
    reconciler = Reconciler(kube, grace_s=args.grace, namespaces=args.namespaces, workers=args.workers,
                            default_ttl_s=args.ttl_seconds_after_finished, coalesce_s=args.coalesce,
                            happy_events=args.events == "all", attempt_timeout_s=args.attempt_timeout)
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
    podbound = PodBound(kube, active=reconciler.active)
    workers = threading.Thread(target=reconciler.run, args=(stop,), name="reconciler", daemon=True)
    renewals = threading.Thread(target=podbound.run, args=(stop,), name="pod-bound", daemon=True)
    health = Health(kube, reconciler, namespaces=args.namespaces, threads=[workers, renewals],
                    elector_alive=elector.alive if elector else None, watches=WatchHealth())
    health.watches.attach()
    queues = QueueController(kube, claimable=reconciler.claimable, active=reconciler.active,
                             synced=health.watches.synced)
    health.check()
    server = _serve_http(args.http_host, args.http_port, ready, elector, health) if args.http_port else None
    workers.start()
    renewals.start()
    threading.Thread(target=health.run, args=(stop,), name="health", daemon=True).start()
    threading.Thread(target=queues.run, args=(stop,), name="queues", daemon=True).start()
    if elector is not None:
        elector.start()
    else:
        reconciler.activate()
    log.info("operator %s starting (%s, leader election %s)", identity,
             "namespaces " + ",".join(args.namespaces) if args.namespaces else "all namespaces",
             "on" if elector else "off")
    try:
        while _run_watches(reconciler, podbound, queues, kube, args, ready, identity, health):
            ready.clear()
            health.watches.reset()  # what the old watches could not do says nothing of the new ones
    finally:
        stop.set()
        if elector is not None:
            elector.stop(timeout_s=2.0)  # hands the Lease over if we lead
        if server is not None:
            server.shutdown()
        log.info("operator %s stopped", identity)
    return 0


def _exit_cleanly(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def _run_watches(reconciler: Reconciler, podbound: PodBound, queues: QueueController, kube: Kube,
                 args: argparse.Namespace, ready: threading.Event, identity: str, health: Health) -> bool:
    """Run our Task and Lease watches and kopf until SIGTERM/SIGINT (False) or until the
    watches must start over (True): the Task CRD was recreated, or a stopped watch can work."""
    # An asyncio.Event on our own loop, not a threading.Event or a concurrent Future: kopf
    # waits for those in an executor thread that cannot be cancelled, which hangs its
    # shutdown on SIGTERM.
    loop = asyncio.new_event_loop()
    loop.set_exception_handler(report_briefly)
    stop = asyncio.Event()
    restart = threading.Event()

    def restart_watches() -> None:
        restart.set()
        loop.call_soon_threadsafe(stop.set)
    health.restart_watches = restart_watches
    reflectors = _reflectors(reconciler, podbound, queues, kube, args.namespaces, health)
    # TaskQueues and slots: optional (an install without the TaskQueue CRD runs without them).
    optional = [r for ns in (args.namespaces or [None]) for r in queues.reflectors(ns)]
    health.watches.track(reflectors, optional=optional)
    for r in [*reflectors, *optional]:
        r.start()
    registry = _registry(reconciler, podbound, kube, health)
    # kopf logs every handler call at INFO; our own log has one line per task transition.
    for name in ("kopf.objects", "kopf.activities"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # Until kopf installs its own, SIGTERM stops kopf through its stop flag: a SystemExit
    # raised inside kopf's starting activities would leave the traceback of a dead task.
    signal.signal(signal.SIGTERM, lambda signum, frame: loop.call_soon_threadsafe(stop.set))

    @kopf.on.cleanup(registry=registry)
    async def release_stop_waiter(**_: Any) -> None:
        # Stopped by a signal, kopf leaves its task waiting on our stop flag pending, then
        # waits 5 s for it before it cancels what is left.
        stop.set()
    try:
        # Our identity, not kopf's default: that asks getpass.getuser(), which fails for a uid
        # without a passwd entry (the image's 65532).
        kopf.run(registry=registry, standalone=True, clusterwide=not args.namespaces,
                 namespaces=args.namespaces or (), ready_flag=ready, stop_flag=stop, loop=loop,
                 identity=identity)  # type: ignore[arg-type]  # kopf.Identity is a NewType kopf does not export
    finally:
        signal.signal(signal.SIGTERM, _exit_cleanly)
        health.restart_watches = lambda: None
        for r in reflectors:
            r.stop()  # a stopped Reflector delivers nothing more, even from a stream still open
        loop.close()
    if restart.is_set():
        log.warning("restarting the watches")
    return restart.is_set()


def report_briefly(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """What asyncio reports on kopf's event loop, in one line; the traceback at DEBUG.

    Only kopf runs tasks on that loop (our handlers only update memory). The report seen is a
    leftover of its shutdown: its API discovery awaits its requests through
    `asyncio.as_completed`, so when it is cancelled, the requests still open are left behind,
    and each ends in the closed session ("Task exception was never retrieved")."""
    exc = context.get("exception")
    log.warning("kopf's event loop: %s%s", context["message"], f" ({exc!r})" if exc else "")
    if exc is not None:
        log.debug("the traceback of what kopf's event loop reported", exc_info=exc)


def _reflectors(reconciler: Reconciler, podbound: PodBound, queues: QueueController, kube: Kube,
                namespaces: list[str] | None, health: Health) -> list[Reflector]:
    """Tasks and Leases (ours only), per namespace or cluster-wide: paginated lists, then watches."""
    def on_task(kind: str, obj: JSON) -> None:
        health.watches.event()
        reconciler.on_task(kind, obj)

    def on_lease(kind: str, obj: JSON) -> None:
        health.watches.event()
        rec = record.read(obj)  # once for the three
        reconciler.on_lease(kind, obj, rec)
        podbound.on_lease(kind, obj, rec)
        queues.on_lease(kind, rec)
    scopes: list[str | None] = [*namespaces] if namespaces else [None]
    store = reconciler.store
    return [r for ns in scopes for r in (
        Reflector(kube, TASKS, namespace=ns, listener=on_task, known=functools.partial(store.task_names, ns),
                  knows=functools.partial(store.holds_task, ns), batch_s=_WATCH_BATCH_S),
        Reflector(kube, LEASES, namespace=ns, listener=on_lease, known=functools.partial(store.lease_names, ns),
                  knows=functools.partial(store.holds_lease, ns), label_selector=record.MANAGED_SELECTOR,
                  batch_s=_WATCH_BATCH_S))]


def _registry(reconciler: Reconciler, podbound: PodBound, kube: Kube, health: Health) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.watching.label_selectors["v1", "pods"] = AGENT_POD_SELECTOR
        settings.watching.field_selectors["apiextensions.k8s.io", "customresourcedefinitions"] = \
            f"metadata.name={CRD_NAME}"
        settings.posting.enabled = False
        # Reconnect at least every 5 minutes; kopf's inactivity timeout (70 s, with
        # bookmarks) catches a silently dead stream sooner.
        settings.watching.server_timeout = 300
        settings.watching.client_timeout = 330

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return _connection_info(kube)

    @kopf.on.event("apiextensions.k8s.io", "v1", "customresourcedefinitions", registry=registry)
    async def crd_event(event: kopf.RawEvent, **_: Any) -> None:
        health.on_crd(event.get("type") or "ADDED", dict(event["object"]))

    @kopf.on.event("v1", "pods", registry=registry)
    async def pod_event(event: kopf.RawEvent, **_: Any) -> None:
        reconciler.on_pod(event.get("type") or "ADDED", dict(event["object"]))
        podbound.on_pod(event.get("type") or "ADDED", dict(event["object"]))

    return registry


def _connection_info(kube: Kube) -> kopf.ConnectionInfo:
    """Hand kopf the exact credentials our own client uses (flag, kubeconfig or in-cluster)."""
    cfg = kube.connection.kubernetes_configuration()
    if cfg.refresh_api_key_hook is not None:
        cfg.refresh_api_key_hook(cfg)
    token = (cfg.api_key or {}).get("authorization", "") or (cfg.api_key or {}).get("BearerToken", "")
    scheme, _, value = token.partition(" ")
    return kopf.ConnectionInfo(
        server=cfg.host, ca_path=cfg.ssl_ca_cert, insecure=not cfg.verify_ssl,
        certificate_path=cfg.cert_file, private_key_path=cfg.key_file,
        scheme=scheme or None, token=value or None, default_namespace=kube.namespace)


def _serve_http(host: str, port: int, ready: threading.Event, elector: LeaderElector | None,
                health: Health) -> ThreadingHTTPServer:
    """`elector`: None without leader election (we lead from the start)."""
    reconciler = health.reconciler

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.path == "/metrics":
                self._reply(200, generate_latest(metrics.REGISTRY), CONTENT_TYPE_LATEST)
            elif self.path == "/healthz":
                dead = health.dead()
                self._reply(503 if dead else 200, (dead or "ok").encode() + b"\n")
            elif self.path == "/readyz":
                # A leader is ready once it has reconciled every Task that existed when it
                # started leading (the initial backlog); a standby once its watches run and
                # its first election attempt has ended (a lone replica is never a standby first).
                # The role is the election's: a leader still seeding is not yet caught up.
                role = "leader" if elector is None or elector.leading.is_set() else "standby"
                decided = elector is None or elector.decided.is_set()
                why = health.not_ready()
                if why:
                    self._reply(503, f"not ready ({role}): {why}\n".encode())
                elif (not ready.is_set() or not health.watches.synced() or not decided
                      or (role == "leader" and not reconciler.caught_up.is_set())):
                    self._reply(503, f"starting {role}\n".encode())
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

    server = _Server((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    log.info("serving /metrics, /healthz and /readyz on %s:%d", host, server.server_address[1])
    return server


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        """A probe that gave up before its answer (a busy operator, a short timeout) hung up:
        nothing went wrong here, so no traceback. Anything else is logged, once, as a warning."""
        exc = sys.exc_info()[1]
        if not isinstance(exc, ConnectionError):
            log.warning("http request from %s failed: %s", client_address[0], exc)

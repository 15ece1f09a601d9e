"""The operator's command-line options, kept apart so that `tasklease --help` never loads kopf."""

from __future__ import annotations

import argparse
import math

from tasklease.api import errors, models
from tasklease.operator.expiry import DEFAULT_GRACE_S
from tasklease.operator.logs import FORMATS

# Reconcile threads. A reconcile mostly waits for its status write, so a few threads keep
# projection behind a loaded API server from falling behind the agents.
DEFAULT_WORKERS = 8
MAX_WORKERS = 256  # a thread each: more would only contend for the API server and the GIL
DEFAULT_COALESCE_S = 0.5  # `Reconciler.coalesce_s` for the command; the class itself coalesces nothing unless told


def add_operator_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--namespace", action="append", dest="namespaces", metavar="NS",
                   help="only watch this namespace (repeatable; default: all namespaces)")
    p.add_argument("-A", "--all-namespaces", action="store_true",
                   help="watch all namespaces (the default when no --namespace is given)")
    p.add_argument("--grace", type=float, default=DEFAULT_GRACE_S,
                   help=f"seconds added to leaseDurationSeconds before a silent holder is expired "
                        f"(default {DEFAULT_GRACE_S:g})")
    p.add_argument("--workers", type=int, default=DEFAULT_WORKERS,
                   help=f"reconcile threads, one task each at a time (default {DEFAULT_WORKERS})")
    p.add_argument("--coalesce", type=float, default=DEFAULT_COALESCE_S, metavar="SECONDS",
                   help="wait this long after a task's first change before projecting it, so that its "
                        f"changes meanwhile make one status write (default {DEFAULT_COALESCE_S:g})")
    p.add_argument("--events", choices=["abnormal", "all"], default="abnormal",
                   help="which transitions become Events on the Task: abnormal ones (Expired, Failed, "
                        "Released, Requeued, DeadLettered, Cancelled; the default) or all (also Claimed "
                        "and Succeeded, two more writes per task)")
    p.add_argument("--http-port", type=int, default=8080,
                   help="port for /metrics, /healthz and /readyz (default 8080; 0 disables)")
    p.add_argument("--http-host", default="0.0.0.0", help="address for the HTTP endpoints (default 0.0.0.0)")
    p.add_argument("--leader-elect", action=argparse.BooleanOptionalAction, default=True,
                   help="elect one active replica through a Lease (default on; off for a single replica)")
    p.add_argument("--leader-election-namespace",
                   help="namespace of the election Lease (default: $POD_NAMESPACE or the kubeconfig's)")
    p.add_argument("--leader-election-lease-duration", type=float, default=15.0,
                   help="seconds a standby waits for a silent leader before taking over (default 15)")
    p.add_argument("--log-format", choices=FORMATS, default="text",
                   help="text: one readable line per event (the default); json: one JSON object per line, "
                        "with time, level, logger and message")
    p.add_argument("--attempt-timeout", type=int, metavar="SECONDS",
                   help="end an attempt that runs longer than this, from its claim as the operator saw it, as a "
                        "failure with reason AttemptTimedOut (retried with backoff), unless the Task's "
                        "spec.attemptTimeoutSeconds says otherwise (default: none)")
    p.add_argument("--ttl-seconds-after-finished", type=int, metavar="SECONDS",
                   help="delete finished Tasks (and their Leases) this long after they finish, unless their "
                        "spec.ttlSecondsAfterFinished says otherwise; dead-lettered ones are kept (default: keep all)")


def validate(args: argparse.Namespace) -> None:
    """Refuse a configuration that cannot work, once, at start, with the reason."""
    if args.all_namespaces and args.namespaces:
        raise errors.Invalid("--all-namespaces and --namespace exclude each other")
    for namespace in args.namespaces or ():
        if not models.is_namespace(namespace):
            raise errors.Invalid(f"--namespace {namespace!r} is not a namespace name (a DNS label)")
    if not math.isfinite(args.grace) or args.grace < 0:
        # An agent gives up at 2/3 of leaseDurationSeconds (its renew deadline); the operator
        # expires at leaseDurationSeconds + grace. A negative grace could expire a holder that
        # still believes it holds its task.
        raise errors.Invalid(f"--grace must be >= 0 (got {args.grace:g}): the operator must never expire a "
                             "lease before its holder's own renew deadline")
    if args.ttl_seconds_after_finished is not None and args.ttl_seconds_after_finished < 0:
        raise errors.Invalid(f"--ttl-seconds-after-finished must be >= 0 (got {args.ttl_seconds_after_finished})")
    if args.attempt_timeout is not None and args.attempt_timeout < 1:
        raise errors.Invalid(f"--attempt-timeout must be at least 1 second (got {args.attempt_timeout})")
    if not math.isfinite(args.coalesce) or args.coalesce < 0:
        raise errors.Invalid(f"--coalesce must be a number of seconds, 0 or more (got {args.coalesce:g})")
    if not 1 <= args.workers <= MAX_WORKERS:
        raise errors.Invalid(f"--workers must be 1 to {MAX_WORKERS} (got {args.workers})")
    if not 0 <= args.http_port <= 65535:
        raise errors.Invalid(f"--http-port must be a port number or 0 (got {args.http_port})")
    if args.leader_elect and not (math.isfinite(args.leader_election_lease_duration)
                                  and args.leader_election_lease_duration >= 1):
        raise errors.Invalid(f"--leader-election-lease-duration must be at least 1 second "
                             f"(got {args.leader_election_lease_duration:g})")

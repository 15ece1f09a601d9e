"""`tasklease` commands for agents: claim, renew, complete, fail, release, and run."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator

from tasklease.agent.identity import own_pod_uid
from tasklease.agent.metrics import AgentMetrics
from tasklease.agent.sdk import Agent, Identity
from tasklease.api import errors
from tasklease.cli.common import kube_of, read_text
from tasklease.kube import NAMESPACES, Kube
from tasklease.protocol import Held, Protocol


def cmd_claim(args: argparse.Namespace) -> int:
    kube = kube_of(args)
    pod_uid = own_pod_uid() if args.pod_bound else ""
    if args.pod_bound and not pod_uid:
        raise errors.Invalid("--pod-bound needs this Pod's uid: set POD_UID from the downward API "
                             "(fieldRef metadata.uid), or mount the Pod's ServiceAccount token")
    if sys.stdout is None:
        raise errors.BadArguments("claim prints the task it claims, and stdout is closed: nothing claimed")
    agent = Agent(kube, identity=Identity.from_environment(handed_over=True))
    with _no_such_namespace_is_not_found(kube):
        task = (agent.claim(args.queue, timeout=args.wait, interrupt=False) if args.wait
                else agent.claim_once(args.queue))
    # The CLI returns at once: the caller renews (tasklease renew) from here on, or the
    # operator does while this Pod runs (--pod-bound).
    task.detach()
    if args.pod_bound:
        try:
            Protocol(kube).bind_to_pod(task.held, pod_uid)
        except errors.TaskleaseError:
            # Not bound, the task must not stay claimed with nobody renewing it.
            with contextlib.suppress(errors.TaskleaseError):
                Protocol(kube).release(task.held, "could not bind the lease to its pod")
            agent.close()
            raise
    out = {"name": task.name, "namespace": task.namespace, "epoch": task.epoch, "holder": task.holder,
           "leaseDurationSeconds": task.held.duration_s, "payload": task.payload}
    try:
        if args.format == "env":
            for key, value in (("TASK", task.name), ("NAMESPACE", task.namespace), ("EPOCH", task.epoch),
                               ("HOLDER", task.holder), ("PAYLOAD", json.dumps(task.payload))):
                print(f"export TASKLEASE_{key}={_shell_quote(str(value))}")
        else:
            print(json.dumps(out))
        sys.stdout.flush()
    except OSError as exc:  # a closed pipe: nobody learns what was claimed, so nobody would work it
        with contextlib.suppress(errors.TaskleaseError):
            Protocol(kube).release(task.held, "its claimer could not print it")
        raise errors.TaskleaseError(f"claimed {task.name} but could not print it ({exc.strerror or exc}); "
                                    "released it") from None
    finally:
        agent.close()
    return 0


def cmd_renew(args: argparse.Namespace) -> int:
    kube, protocol = _held_by_args(args)
    protocol.renew(protocol.adopt(kube.namespace, args.name, holder=args.holder, epoch=args.epoch))
    return 0


def cmd_complete(args: argparse.Namespace) -> int:
    result = args.result
    if args.result_file:
        result = read_text(args.result_file)
    return _end(args, "Succeeded", lambda p, h: p.complete(h, result), result=result)


def cmd_fail(args: argparse.Namespace) -> int:
    return _end(args, "Failed", lambda p, h: p.fail(h, args.message, retryable=not args.final))


def cmd_release(args: argparse.Namespace) -> int:
    return _end(args, "Released", lambda p, h: p.release(h))


def _end(args: argparse.Namespace, outcome: str, write: Callable[[Protocol, Held], Held],
         result: str = "") -> int:
    kube, protocol = _held_by_args(args)
    protocol.end(kube.namespace, args.name, holder=args.holder, epoch=args.epoch, outcome=outcome,
                 write=lambda held: write(protocol, held), result=result)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from tasklease.agent.runner import Runner

    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise errors.BadArguments("run needs a command: tasklease run --queue Q -- CMD ARGS...")
    if args.timeout is not None and args.timeout <= 0:
        raise errors.BadArguments(f"--timeout must be more than 0 seconds (got {args.timeout:g})")
    metrics = AgentMetrics() if args.metrics_port is not None else None
    if metrics is not None:
        try:
            metrics.serve(args.metrics_port, args.metrics_host)
        except OSError as exc:
            raise errors.Invalid(f"--metrics-port {args.metrics_port}: cannot listen on {args.metrics_host}: "
                                 f"{exc.strerror or exc}") from None
    # A connection for each loop's requests (its renewals run beside them), beyond the agent's
    # own: fewer, and urllib3 warns of a full pool at every request past it.
    kube = kube_of(args, pool_size=16 + 2 * args.concurrency)
    # Leaving the block leaves the queue: our peers divide our share at once.
    with (Agent(kube, identity=Identity.from_environment(), metrics=metrics) as agent,
          _no_such_namespace_is_not_found(kube)):
        runner = Runner(agent, queue=args.queue, argv=cmd, grace_s=args.grace, concurrency=args.concurrency,
                        drain=args.drain, timeout_s=args.timeout)
        return runner.run(loop=args.loop, wait_s=args.wait)


@contextlib.contextmanager
def _no_such_namespace_is_not_found(kube: Kube) -> Iterator[None]:
    """An empty queue and a namespace that does not exist both list no tasks: tell them apart."""
    try:
        yield
    except errors.NothingToClaim:
        try:
            kube.get(NAMESPACES, kube.namespace)
        except errors.NotFound:
            raise errors.NotFound(f"namespace {kube.namespace!r} does not exist") from None
        except errors.Forbidden:
            pass  # we may not look: an empty queue it is
        raise


def _held_by_args(args: argparse.Namespace) -> tuple[Kube, Protocol]:
    if not args.name or not args.holder or args.epoch is None:
        raise errors.BadArguments("need the task name, --holder and --epoch (or TASKLEASE_TASK, TASKLEASE_HOLDER "
                                  "and TASKLEASE_EPOCH) as printed by `tasklease claim`")
    # Like the name, holder and epoch: the namespace `claim --format env` printed, unless -n says.
    args.namespace = args.namespace or os.environ.get("TASKLEASE_NAMESPACE") or None
    kube = kube_of(args)
    return kube, Protocol(kube)


def _shell_quote(value: str) -> str:
    return "'" + value.replace("'", "'\"'\"'") + "'"

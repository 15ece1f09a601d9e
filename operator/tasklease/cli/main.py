"""`tasklease` (and `kubectl tasklease`): parse, call, print. One clear line on error.

The exit codes are `tasklease.api.errors.exit_codes()`, printed by `tasklease --help`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from tasklease.api import errors, models, timestamps
from tasklease.agent.sdk import Agent, Identity
from tasklease.kube import EVENTS, NAMESPACES, TASKS, Kube
from tasklease.protocol import Held, Protocol, TaskView

EPILOG = "exit codes:\n" + "".join(f"  {code:>3}  {meaning}\n" for code, meaning in errors.exit_codes()) + """
examples:
  tasklease submit --queue emails --payload '{"to": "a@example.com"}'
  tasklease list --queue emails
  tasklease run --queue emails --loop -- ./send-email.sh
  eval "$(tasklease claim --queue emails --format env)" && ... && tasklease complete "$TASKLEASE_TASK"
"""

# The model's defaults, quoted in --help (never restated).
_SPEC = models.TaskSpec(queue="q")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO if args.command in ("run", "operator")
                        else logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.handler(args) or 0)
    except errors.TaskleaseError as exc:
        print(f"tasklease: {_first_line(str(exc)) or type(exc).__name__}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except (OSError, ValueError) as exc:  # a file, a port, a value: still one line, all of it
        print(f"tasklease: {type(exc).__name__}: {'; '.join(str(exc).split(chr(10)))}", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config, in-cluster)")
    common.add_argument("--context", help="kubeconfig context to use")
    common.add_argument("-v", "--verbose", action="store_true", help="log what happens")

    parser = argparse.ArgumentParser(
        prog="tasklease", description="Give every unit of work exactly one current owner, on Kubernetes.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, handler: Any) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help, description=help, epilog=EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(handler=handler)
        if name != "operator":  # the operator's -n restricts what it watches (kopf's convention)
            p.add_argument("-n", "--namespace", help="namespace (default: the kubeconfig context's, or the pod's)")
        return p

    p = command("submit", "create a task (from flags, or from YAML files with -f)", cmd_submit)
    p.add_argument("-f", "--filename", action="append", help="YAML file of Task objects ('-' for stdin)")
    p.add_argument("--queue", help="queue name (a DNS label)")
    p.add_argument("--name", help="task name (default: generated from the queue)")
    p.add_argument("--payload", help="payload as a JSON object")
    p.add_argument("--payload-file", help="file holding the payload as JSON")
    p.add_argument("--priority", type=int, help=f"higher runs first (default {_SPEC.priority})")
    p.add_argument("--max-attempts", type=int, help=f"claims before dead-lettering (default {_SPEC.max_attempts})")
    p.add_argument("--lease-duration", type=int,
                   help=f"lease duration in seconds (default {_SPEC.lease_duration_seconds})")
    p.add_argument("--backoff-initial", type=int,
                   help=f"seconds before the second attempt (default {_SPEC.backoff.initial_seconds})")
    p.add_argument("--backoff-max", type=int,
                   help=f"upper bound of the backoff (default {_SPEC.backoff.max_seconds})")
    p.add_argument("--backoff-policy", choices=[p.value for p in models.BackoffPolicy],
                   help=f"(default {_SPEC.backoff.policy.value})")
    p.add_argument("--deadline", help="RFC 3339 time after which the task fails (DeadlineExceeded)")

    p = command("list", "list tasks", cmd_list)
    p.add_argument("--queue", help="only this queue (filtered by the API server)")
    p.add_argument("-A", "--all-namespaces", action="store_true")

    p = command("get", "print a task as YAML or JSON", cmd_get)
    p.add_argument("name")
    p.add_argument("-o", "--output", choices=["yaml", "json"], default="yaml")

    p = command("describe", "a task's spec, live lease, history and events", cmd_describe)
    p.add_argument("name")

    p = command("claim", "claim one task of a queue; prints it (exit 3 when nothing is claimable)", cmd_claim)
    p.add_argument("--queue", required=True)
    p.add_argument("--wait", type=float, default=0, help="seconds to wait for a task (default: do not wait)")
    p.add_argument("--format", choices=["json", "env"], default="json",
                   help="json, or shell `export` lines for eval (TASKLEASE_TASK, _EPOCH, _HOLDER, _PAYLOAD)")

    for name, help, handler in (("renew", "renew a held lease", cmd_renew),
                                ("complete", "complete a held task with a result", cmd_complete),
                                ("fail", "fail the current attempt (retried with backoff unless --final)", cmd_fail),
                                ("release", "give a held task back at once, without backoff", cmd_release)):
        p = command(name, help, handler)
        p.add_argument("name", nargs="?", default=os.environ.get("TASKLEASE_TASK"),
                       help="task name (default: $TASKLEASE_TASK)")
        p.add_argument("--holder", default=os.environ.get("TASKLEASE_HOLDER"),
                       help="holder identity printed by claim (default: $TASKLEASE_HOLDER)")
        p.add_argument("--epoch", type=int, default=_env_int("TASKLEASE_EPOCH"),
                       help="attempt epoch printed by claim (default: $TASKLEASE_EPOCH)")
        if name == "complete":
            p.add_argument("--result", default="", help="result text (limit 8192 characters)")
            p.add_argument("--result-file", help="read the result from a file ('-' for stdin)")
        if name == "fail":
            p.add_argument("--message", "-m", default="failed", help="what went wrong")
            p.add_argument("--final", action="store_true", help="do not retry: the task ends Failed")

    p = command("cancel", "cancel a task: its holder loses the lease, the task ends Cancelled", cmd_cancel)
    p.add_argument("name")

    p = command("requeue", "end the current attempt now and make the task claimable at once", cmd_requeue)
    p.add_argument("name")

    p = command("run", "claim a task, run CMD for it, complete on exit 0, fail otherwise", cmd_run)
    p.add_argument("--queue", required=True)
    p.add_argument("--loop", action="store_true", help="keep taking tasks until stopped")
    p.add_argument("--wait", type=float, help="seconds to wait for a task (default: once: none; --loop: forever)")
    p.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL (default 10)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ARGS", help="the command to run")

    p = command("operator", "run the operator (kopf): status, expiry, requeue, dead letters", cmd_operator)
    from tasklease.operator.options import add_operator_arguments

    add_operator_arguments(p)
    return parser


# -- handlers -----------------------------------------------------------------------


def cmd_submit(args: argparse.Namespace) -> int:
    kube = _kube(args)
    bodies = _task_files(args.filename) if args.filename else [_task_from_flags(args)]
    for body in bodies:
        created = kube.create(TASKS, body, namespace=body.get("metadata", {}).get("namespace") or kube.namespace)
        print(f"task/{created['metadata']['name']} created")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    kube = _kube(args)
    items = kube.list(TASKS, all_namespaces=args.all_namespaces,
                      field_selector=f"spec.queue={args.queue}" if args.queue else "")["items"]
    rows = [["NAMESPACE"] if args.all_namespaces else []]
    rows[0] += ["NAME", "QUEUE", "PHASE", "HOLDER", "ATTEMPT", "AGE"]
    for t in sorted(items, key=lambda t: (t["metadata"]["namespace"], t["metadata"]["creationTimestamp"])):
        status = t.get("status") or {}
        row = [t["metadata"]["namespace"]] if args.all_namespaces else []
        row += [t["metadata"]["name"], t["spec"]["queue"], status.get("phase", "Pending"), status.get("holder") or "-",
                str(status.get("attempt", 0)), _age(t["metadata"]["creationTimestamp"])]
        rows.append(row)
    _print_table(rows)
    return 0


def cmd_get(args: argparse.Namespace) -> int:
    task = _kube(args).get(TASKS, args.name)
    print(json.dumps(task, indent=2) if args.output == "json" else yaml.safe_dump(task, sort_keys=False), end="\n")
    return 0


def cmd_describe(args: argparse.Namespace) -> int:
    kube = _kube(args)
    task = kube.get(TASKS, args.name)
    status = models.TaskStatus.model_validate(task.get("status") or {})
    rec = Protocol(kube).read(kube.namespace, args.name)
    spec = task["spec"]
    print(f"Name:       {args.name}\nNamespace:  {kube.namespace}\nQueue:      {spec['queue']}\n"
          f"Priority:   {spec.get('priority', 0)}\nAttempts:   {status.attempt} of {spec.get('maxAttempts', 3)}\n"
          f"Phase:      {status.phase.value}{f' ({status.reason})' if status.reason else ''}\n"
          f"Holder:     {status.holder or '-'}")
    if rec is None:
        print("Lease:      none yet (never claimed)")
    else:
        print(f"Lease:      {rec.state}{f' by {rec.holder}' if rec.holder else ''}, epoch {rec.epoch}, "
              f"duration {rec.duration_s}s{f', outcome {rec.outcome}' if rec.outcome else ''}")
        if rec.not_before:
            print(f"Not before: {rec.not_before.isoformat()}")
    if status.result:
        print(f"Result:     {_first_line(status.result)}")
    if status.last_error:
        print(f"Last error: {status.last_error}")
    print("History:")
    for a in (rec.history if rec else status.history):
        print(f"  #{a.attempt} {a.holder}  {a.outcome or 'running'}  {a.message}")
    events = kube.list(EVENTS, field_selector=f"involvedObject.name={args.name},involvedObject.kind=Task")["items"]
    print("Events:")
    for e in sorted(events, key=lambda e: int(e["metadata"]["resourceVersion"])):
        print(f"  {e.get('type', '')}  {e.get('reason', '')}  {e.get('message', '')}")
    return 0


def cmd_claim(args: argparse.Namespace) -> int:
    kube = _kube(args)
    agent = Agent(kube, identity=Identity.from_environment(handed_over=True))
    with _no_such_namespace_is_not_found(kube):
        task = (agent.claim(args.queue, timeout=args.wait, interrupt=False) if args.wait
                else agent.claim_once(args.queue))
    # The CLI returns at once: the caller renews (tasklease renew) from here on.
    task.detach()
    out = {"name": task.name, "namespace": task.namespace, "epoch": task.epoch, "holder": task.holder,
           "leaseDurationSeconds": task.held.duration_s, "payload": task.payload}
    if args.format == "env":
        for key, value in (("TASK", task.name), ("NAMESPACE", task.namespace), ("EPOCH", task.epoch),
                           ("HOLDER", task.holder), ("PAYLOAD", json.dumps(task.payload))):
            print(f"export TASKLEASE_{key}={_shell_quote(str(value))}")
    else:
        print(json.dumps(out))
    agent.close()
    return 0


def cmd_renew(args: argparse.Namespace) -> int:
    kube, protocol = _held_by_args(args)
    protocol.renew(protocol.adopt(kube.namespace, args.name, holder=args.holder, epoch=args.epoch))
    return 0


def cmd_complete(args: argparse.Namespace) -> int:
    result = args.result
    if args.result_file:
        result = sys.stdin.read() if args.result_file == "-" else Path(args.result_file).read_text()
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


def cmd_cancel(args: argparse.Namespace) -> int:
    kube = _kube(args)
    kube.merge_patch(TASKS, args.name, {"spec": {"cancel": True}})
    print(f"task/{args.name} cancel requested")
    return 0


def cmd_requeue(args: argparse.Namespace) -> int:
    kube = _kube(args)
    protocol = Protocol(kube)
    task = TaskView.of(kube.get(TASKS, args.name))
    protocol.requeue(task, protocol.read(kube.namespace, args.name), message="requeued by tasklease requeue")
    print(f"task/{args.name} requeued")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from tasklease.agent.runner import Runner

    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise errors.Invalid("run needs a command: tasklease run --queue Q -- CMD ARGS...")
    kube = _kube(args)
    agent = Agent(kube, identity=Identity.from_environment())
    with _no_such_namespace_is_not_found(kube):
        return Runner(agent, queue=args.queue, argv=cmd, grace_s=args.grace).run(loop=args.loop, wait_s=args.wait)


def cmd_operator(args: argparse.Namespace) -> int:
    from tasklease.operator.controller import run_operator

    return run_operator(args)


# -- helpers ------------------------------------------------------------------------------


def _kube(args: argparse.Namespace) -> Kube:
    kube = Kube.connect(kubeconfig=args.kubeconfig, context=args.context, namespace=args.namespace)
    return kube


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
        raise errors.Invalid("need the task name, --holder and --epoch (or TASKLEASE_TASK, TASKLEASE_HOLDER "
                             "and TASKLEASE_EPOCH) as printed by `tasklease claim`")
    kube = _kube(args)
    return kube, Protocol(kube)


def _task_from_flags(args: argparse.Namespace) -> dict[str, Any]:
    if not args.queue:
        raise errors.Invalid("submit needs --queue (or -f FILE)")
    payload: Any = {}
    try:
        if args.payload_file:
            payload = json.loads(Path(args.payload_file).read_text())
        elif args.payload:
            payload = json.loads(args.payload)
    except (OSError, ValueError) as exc:
        raise errors.Invalid(f"payload is not valid JSON: {exc}") from None
    spec: dict[str, Any] = {"queue": args.queue, "payload": payload}
    for flag, field in (("priority", "priority"), ("max_attempts", "maxAttempts"),
                        ("lease_duration", "leaseDurationSeconds"), ("deadline", "deadline")):
        if getattr(args, flag) is not None:
            spec[field] = getattr(args, flag)
    backoff = {k: v for k, v in (("initialSeconds", args.backoff_initial), ("maxSeconds", args.backoff_max),
                                 ("policy", args.backoff_policy)) if v is not None}
    if backoff:
        spec["backoff"] = backoff
    meta = {"name": args.name} if args.name else {"generateName": f"{args.queue}-"}
    return {"apiVersion": f"{models.GROUP}/{models.VERSION}", "kind": models.KIND, "metadata": meta, "spec": spec}


def _task_files(paths: list[str]) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in paths:
        try:
            text = sys.stdin.read() if path == "-" else Path(path).read_text()
            docs += [d for d in yaml.safe_load_all(text) if d]
        except (OSError, yaml.YAMLError) as exc:
            raise errors.Invalid(f"cannot read {path}: {_first_line(str(exc))}") from None
    return docs


def _print_table(rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("   ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())


def _age(timestamp: str) -> str:
    seconds = int((timestamps.now_utc() - (timestamps.parse_time(timestamp) or timestamps.now_utc())).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def _shell_quote(value: str) -> str:
    return "'" + value.replace("'", "'\"'\"'") + "'"


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value and value.isdigit() else None


if __name__ == "__main__":
    raise SystemExit(main())

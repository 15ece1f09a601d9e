"""`tasklease` (and `kubectl tasklease`): parse, call, print. One clear line on error.

The exit codes are `tasklease.api.errors.exit_codes()`, printed by `tasklease --help`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from tasklease.agent.producer import same_spec
from tasklease.agent.sdk import Agent, Identity
from tasklease.api import errors, models
from tasklease.cli import output
from tasklease.cli.follow import follow
from tasklease.kube import EVENTS, TASKS, Kube
from tasklease.protocol import Held, Protocol, TaskView

EPILOG = "exit codes:\n" + "".join(f"  {code:>3}  {meaning}\n" for code, meaning in errors.exit_codes()) + """
global flags (--kubeconfig, --context, -n/--namespace, -v) go before or after the command.

examples:
  tasklease submit --queue emails --payload '{"to": "a@example.com"}'
  tasklease -n shop list --queue emails -o wide
  tasklease run --queue emails --loop -- ./send-email.sh
  eval "$(tasklease claim --queue emails --format env)" && ... && tasklease complete "$TASKLEASE_TASK"
  tasklease retry --queue emails --reason DeadLettered
"""
_SEE_CODES = "exit codes: see `tasklease --help`."

# The model's defaults, quoted in --help (never restated).
_SPEC = models.TaskSpec(queue="q")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO if args.command in ("run", "operator")
                        else logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.handler(args) or 0)
    except BrokenPipeError:
        # `tasklease list | head`: the reader has what it wanted. Quiet, and no second
        # complaint when Python flushes stdout on the way out.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except errors.TaskleaseError as exc:
        print(f"tasklease: {_first_line(str(exc)) or type(exc).__name__}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except (OSError, ValueError) as exc:  # a file, a port, a value: still one line, all of it
        print(f"tasklease: {type(exc).__name__}: {'; '.join(str(exc).split(chr(10)))}", file=sys.stderr)
        return 1


def _add_common(p: argparse.ArgumentParser, *, sub: bool, namespace: bool = True) -> None:
    """The global flags. On a subcommand they default to SUPPRESS, so `tasklease -n NS list`
    and `tasklease list -n NS` both work and neither erases the other."""
    kw: dict[str, Any] = {"default": argparse.SUPPRESS} if sub else {}
    p.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config, in-cluster)", **kw)
    p.add_argument("--context", help="kubeconfig context to use", **kw)
    if sub:
        p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log what happens")
    else:
        p.add_argument("-v", "--verbose", action="store_true", help="log what happens")
    if namespace:
        p.add_argument("-n", "--namespace", help="namespace (default: the kubeconfig context's, or the pod's)", **kw)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tasklease", description="Give every unit of work exactly one current owner, on Kubernetes.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"tasklease {_version()}")
    _add_common(parser, sub=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, handler: Any, example: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".",
                           epilog=f"example:\n  {example}\n\n{_SEE_CODES}",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(handler=handler)
        # The operator's -n restricts what it watches (kopf's convention): its own flag.
        _add_common(p, sub=True, namespace=name != "operator")
        return p

    p = command("submit", "create tasks, from flags or from YAML files (-f); existing names are reported, "
                "not overwritten", cmd_submit,
                "tasklease submit --queue emails --name mail-42 --payload '{\"to\": 42}'")
    p.add_argument("-f", "--filename", action="append", help="YAML file of Task objects ('-' for stdin)")
    p.add_argument("--queue", help="queue name (a DNS label)")
    p.add_argument("--name", help="task name, the idempotency key (default: generated from the queue)")
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
    p.add_argument("--not-before", help="RFC 3339 time before which no attempt starts (a delayed start)")
    p.add_argument("--ttl", type=int, dest="ttl", metavar="SECONDS",
                   help="delete the task this long after it finishes (spec.ttlSecondsAfterFinished)")

    p = command("list", "list tasks, as a table or in another format; --watch follows changes", cmd_list,
                "tasklease list --queue emails --phase Failed -o wide")
    p.add_argument("--queue", help="only this queue (filtered by the API server)")
    p.add_argument("--phase", choices=[ph.value for ph in models.Phase],
                   help="only this phase (Pending includes tasks the operator has not seen yet)")
    p.add_argument("-l", "--selector", default="", help="label selector, e.g. team=shop")
    p.add_argument("-A", "--all-namespaces", action="store_true", help="tasks of every namespace")
    p.add_argument("-w", "--watch", action="store_true", help="after the list, print each change as it happens")
    p.add_argument("-o", "--output", type=output.check_format, metavar="FORMAT",
                   help="wide, json, yaml, name or jsonpath=TEMPLATE (default: a table)")

    p = command("get", "print one task (default YAML)", cmd_get, "tasklease get mail-42 -o jsonpath='{.status.phase}'")
    p.add_argument("name")
    p.add_argument("-o", "--output", type=output.check_format, default="yaml", metavar="FORMAT",
                   help="yaml (default), json, wide, name or jsonpath=TEMPLATE")

    p = command("describe", "a task's spec, live lease, history and events", cmd_describe,
                "tasklease describe mail-42")
    p.add_argument("name")

    p = command("claim", "claim one task of a queue and print it (exit 3 when nothing is claimable)", cmd_claim,
                'eval "$(tasklease claim --queue emails --format env)"')
    p.add_argument("--queue", required=True)
    p.add_argument("--wait", type=float, default=0, help="seconds to wait for a task (default: do not wait)")
    p.add_argument("--format", choices=["json", "env"], default="json",
                   help="json, or shell `export` lines for eval (TASKLEASE_TASK, _EPOCH, _HOLDER, _PAYLOAD)")

    for name, help, handler, example in (
            ("renew", "renew a held lease", cmd_renew, "tasklease renew  # uses $TASKLEASE_TASK/_HOLDER/_EPOCH"),
            ("complete", "complete a held task with a result", cmd_complete, "tasklease complete --result done"),
            ("fail", "fail the current attempt (retried with backoff unless --final)", cmd_fail,
             "tasklease fail -m 'upstream said 503'"),
            ("release", "give a held task back at once, without backoff", cmd_release, "tasklease release")):
        p = command(name, help, handler, example)
        p.add_argument("name", nargs="?", default=os.environ.get("TASKLEASE_TASK"),
                       help="task name (default: $TASKLEASE_TASK)")
        p.add_argument("--holder", default=os.environ.get("TASKLEASE_HOLDER"),
                       help="holder identity printed by claim (default: $TASKLEASE_HOLDER)")
        p.add_argument("--epoch", type=int, default=_env_int("TASKLEASE_EPOCH"),
                       help="attempt epoch printed by claim (default: $TASKLEASE_EPOCH)")
        if name == "complete":
            p.add_argument("--result", default="", help=f"result text (limit {models.MAX_RESULT_BYTES} characters; "
                                                        "store larger results elsewhere and put a reference here)")
            p.add_argument("--result-file", help="read the result from a file ('-' for stdin)")
        if name == "fail":
            p.add_argument("--message", "-m", default="failed", help="what went wrong")
            p.add_argument("--final", action="store_true", help="do not retry: the task ends Failed")

    p = command("cancel", "cancel a task: its holder stops at once, the task ends Cancelled", cmd_cancel,
                "tasklease cancel mail-42")
    p.add_argument("name")

    p = command("requeue", "end the current attempt now and make the task claimable at once", cmd_requeue,
                "tasklease requeue mail-42")
    p.add_argument("name")

    p = command("retry", "give Failed (dead-lettered) tasks a fresh budget of attempts; history and epoch stay",
                cmd_retry, "tasklease retry --queue emails --reason DeadLettered")
    p.add_argument("names", nargs="*", metavar="NAME", help="tasks to retry (or select them with the flags)")
    p.add_argument("--queue", help="every Failed task of this queue")
    p.add_argument("-l", "--selector", default="", help="only Failed tasks with these labels")
    p.add_argument("--reason", help="only Failed tasks with this status.reason, e.g. DeadLettered")

    p = command("top", "a live view of the queues: counts, rates, oldest pending, slowest running, holders",
                cmd_top, "tasklease top -A")
    p.add_argument("-A", "--all-namespaces", action="store_true", help="every namespace")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit (for scripts)")

    p = command("run", "claim a task, run CMD for it, complete on exit 0, fail otherwise", cmd_run,
                "tasklease run --queue emails --loop -- ./send-email.sh")
    p.add_argument("--queue", required=True)
    p.add_argument("--loop", action="store_true", help="keep taking tasks until stopped")
    p.add_argument("--wait", type=float, help="seconds to wait for a task (default: once: none; --loop: forever)")
    p.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL (default 10)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ARGS", help="the command to run")

    p = command("operator", "run the operator (kopf): status, expiry, requeue, dead letters, cleanup",
                cmd_operator, "tasklease operator --namespace shop --no-leader-elect")
    from tasklease.operator.options import add_operator_arguments

    add_operator_arguments(p)
    return parser


# -- handlers -----------------------------------------------------------------------


def cmd_submit(args: argparse.Namespace) -> int:
    """Each task is reported on its own line and the others go on: a name that exists with the
    same spec is the same task submitted again (names are idempotency keys), exit 0; one that
    exists with another spec, or is refused, is named and makes the exit code non-zero."""
    kube = _kube(args)
    bodies = _task_files(args.filename) if args.filename else [_task_from_flags(args)]
    worst = 0
    for body in bodies:
        namespace = body.get("metadata", {}).get("namespace") or kube.namespace
        name = body.get("metadata", {}).get("name") or ""
        try:
            created = kube.create(TASKS, body, namespace=namespace)
            print(f"task/{created['metadata']['name']} created")
        except errors.Conflict:
            existing = kube.get(TASKS, name, namespace=namespace)
            if same_spec(existing.get("spec") or {}, body.get("spec") or {}):
                print(f"task/{name} unchanged (already submitted)")
                continue
            print(f"tasklease: task/{name} already exists with another spec; left as it is", file=sys.stderr)
            worst = max(worst, errors.Conflict.exit_code)
        except errors.TaskleaseError as exc:
            print(f"tasklease: task/{name or '?'}: {_first_line(str(exc))}", file=sys.stderr)
            worst = max(worst, exc.exit_code)
    return worst


def cmd_list(args: argparse.Namespace) -> int:
    kube = _kube(args)
    field = f"spec.queue={args.queue}" if args.queue else ""
    listed = kube.list(TASKS, all_namespaces=args.all_namespaces, label_selector=args.selector,
                       field_selector=field)
    items = sorted((t for t in listed["items"] if _phase_matches(t, args.phase)),
                   key=lambda t: (t["metadata"]["namespace"], t["metadata"]["creationTimestamp"]))
    text = output.render(items, args.output, single=False, all_namespaces=args.all_namespaces)
    if text or args.output in ("json", "yaml"):
        print(text, flush=True)
    elif not args.watch:
        print("No tasks found." if not args.all_namespaces else "No tasks found in any namespace.", file=sys.stderr)
    if args.watch:
        _follow(kube, args, listed["metadata"]["resourceVersion"])
    return 0


def _phase_matches(task: dict[str, Any], phase: str | None) -> bool:
    current = (task.get("status") or {}).get("phase") or ""
    return phase is None or current == phase or (phase == models.Phase.PENDING.value and not current)


def _follow(kube: Kube, args: argparse.Namespace, resource_version: str) -> None:
    """`list --watch`: one line per change, in the list's format, until interrupted."""
    def show(kind: str, obj: dict[str, Any]) -> None:
        if not _phase_matches(obj, args.phase):
            return
        if args.output in (None, "wide"):
            line = "   ".join(output.row(obj, wide=args.output == "wide", all_namespaces=args.all_namespaces))
        else:
            line = output.render([obj], args.output, single=True)
        print(line, flush=True)
    follow(kube, TASKS, namespace=None if args.all_namespaces else kube.namespace, on_event=show,
           label_selector=args.selector, field_selector=f"spec.queue={args.queue}" if args.queue else "",
           skip_list=resource_version)


def cmd_get(args: argparse.Namespace) -> int:
    task = _kube(args).get(TASKS, args.name)
    print(output.render([task], args.output, single=True))
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
    agent = Agent(_kube(args), identity=Identity.from_environment(handed_over=True))
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


def cmd_retry(args: argparse.Namespace) -> int:
    """Redrive: each Failed task gets maxAttempts more claims (one Lease write each); the
    operator then projects it back to Pending and agents claim it. Reports every task."""
    kube = _kube(args)
    protocol = Protocol(kube)
    if args.names:
        if args.queue or args.selector or args.reason:
            raise errors.Invalid("retry takes task names or --queue/-l/--reason, not both")
        tasks = [kube.get(TASKS, name) for name in args.names]
    elif args.queue or args.selector or args.reason:
        field = ",".join([f"status.phase={models.Phase.FAILED.value}", *([f"spec.queue={args.queue}"]
                                                                      if args.queue else [])])
        tasks = [t for t in kube.list(TASKS, label_selector=args.selector, field_selector=field)["items"]
                 if args.reason is None or (t.get("status") or {}).get("reason") == args.reason]
    else:
        raise errors.Invalid("retry needs task names, or --queue, -l or --reason to select Failed tasks")
    worst = 0
    for task in sorted(tasks, key=lambda t: t["metadata"]["name"]):
        view = TaskView.of(task)
        try:
            rec = protocol.retry(view, protocol.read(view.namespace, view.name))
        except errors.TaskleaseError as exc:
            print(f"tasklease: {_first_line(str(exc))}", file=sys.stderr)
            worst = max(worst, exc.exit_code)
            continue
        print(f"task/{view.name} retried: up to {view.spec.max_attempts} more attempts from attempt {rec.epoch + 1}")
    if not tasks:
        print("no Failed task matched", file=sys.stderr)
    return worst


def cmd_top(args: argparse.Namespace) -> int:
    from tasklease.cli import top

    kube = _kube(args)
    return top.run(kube, namespace=None if args.all_namespaces else kube.namespace, once=args.once)


def cmd_run(args: argparse.Namespace) -> int:
    from tasklease.agent.runner import Runner

    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise errors.Invalid("run needs a command: tasklease run --queue Q -- CMD ARGS...")
    agent = Agent(_kube(args), identity=Identity.from_environment())
    return Runner(agent, queue=args.queue, argv=cmd, grace_s=args.grace).run(loop=args.loop, wait_s=args.wait)


def cmd_operator(args: argparse.Namespace) -> int:
    from tasklease.operator.controller import run_operator

    if getattr(args, "namespace", None) and not args.namespaces:  # `tasklease -n NS operator`
        args.namespaces = [args.namespace]

    return run_operator(args)


# -- helpers ------------------------------------------------------------------------------


def _kube(args: argparse.Namespace) -> Kube:
    kube = Kube.connect(kubeconfig=args.kubeconfig, context=args.context, namespace=args.namespace)
    return kube


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
                        ("lease_duration", "leaseDurationSeconds"), ("deadline", "deadline"),
                        ("not_before", "notBefore"), ("ttl", "ttlSecondsAfterFinished")):
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


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def _shell_quote(value: str) -> str:
    return "'" + value.replace("'", "'\"'\"'") + "'"


def _version() -> str:
    try:
        return importlib.metadata.version("tasklease")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value and value.isdigit() else None


if __name__ == "__main__":
    raise SystemExit(main())

"""`tasklease` (and `kubectl tasklease`): the parser and the one-line error handling.

The commands live by concern: `tasks` (submit, list, get, ...), `work` (claim ... run),
`queues` (pause, resume), `top`; `output` formats, `follow` lists and watches. The exit codes are
`tasklease.api.errors.exit_codes()`, printed by `tasklease --help` only.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from tasklease.agent.runner import MAX_CONCURRENCY
from tasklease.api import errors, models
from tasklease.api.build import version
from tasklease.cli import completion, output
from tasklease.cli.common import first_line, kube_of
from tasklease.cli.queues import cmd_pause, cmd_resume
from tasklease.cli.tasks import cmd_cancel, cmd_describe, cmd_get, cmd_list, cmd_requeue, cmd_retry, cmd_submit
from tasklease.cli.work import cmd_claim, cmd_complete, cmd_fail, cmd_release, cmd_renew, cmd_run
from tasklease.operator.logs import TEXT_LINE

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

def _seconds(text: str) -> float:
    """A duration flag: a finite number of seconds, not negative."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"not a number of seconds (finite, 0 or more): {text!r}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"not a port number (0 to 65535): {text!r}")
    return value


def _namespace(text: str) -> str:
    if not models.is_namespace(text):
        raise argparse.ArgumentTypeError(f"not a namespace name (a DNS label): {text!r}")
    return text


def _queue(text: str) -> str:
    """A queue to select by: a name no task's queue can have would select nothing (or leak the
    field selector's syntax into the API server's answer)."""
    try:
        return models.check_queue(text)
    except errors.Invalid as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _concurrency(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of commands: {text!r}") from None
    if not 1 <= value <= MAX_CONCURRENCY:
        raise argparse.ArgumentTypeError(f"not a number of commands (1 to {MAX_CONCURRENCY}): {text!r}")
    return value


# The model's defaults, quoted in --help (never restated).
_SPEC = models.TaskSpec(queue="q")


class _Parser(argparse.ArgumentParser):
    """A bad flag is one line too, as every other error is: the usage is one --help away."""

    def error(self, message: str) -> NoReturn:
        self.exit(errors.BadArguments.exit_code, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    for arg in argv:
        if not _utf8(arg):
            # Bytes the locale could not decode: no name, queue or payload is made of them.
            shown = arg.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
            print(f"tasklease: error: an argument is not UTF-8 text: {shown}", file=sys.stderr)
            return errors.BadArguments.exit_code
    parser = build_parser()
    args = parser.parse_args(argv)
    # A one-shot command says how it ended in one line (below); what it retried on the way (a
    # page of a list, a watch: warnings) is told with -v. `run` and the operator are long-lived: they log.
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO if args.command in ("run", "operator")
                        else logging.ERROR, format=TEXT_LINE)
    try:
        return int(args.handler(args) or 0)
    except BrokenPipeError:
        # `tasklease list | head`: the reader has what it wanted. Quiet, and no second
        # complaint when Python flushes stdout on the way out.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except errors.TaskleaseError as exc:
        print(f"tasklease: {first_line(str(exc)) or type(exc).__name__}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return errors.INTERRUPTED
    except (OSError, ValueError) as exc:  # a file, a port, a value: still one line, all of it
        print(f"tasklease: {type(exc).__name__}: {'; '.join(str(exc).split(chr(10)))}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - a bug, or input nobody foresaw: one line still; -v shows where
        logging.getLogger("tasklease").debug("the traceback", exc_info=exc)
        print(f"tasklease: unexpected error: {type(exc).__name__}: {first_line(str(exc))}"
              f"{'' if args.verbose else ' (-v shows where)'}", file=sys.stderr)
        return 1


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _add_common(p: argparse.ArgumentParser, *, sub: bool, namespace: bool = True,
                namespace_default: str = "the kubeconfig context's, or the pod's") -> None:
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
        p.add_argument("-n", "--namespace", type=_namespace, help=f"namespace (default: {namespace_default})", **kw)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="tasklease", description="Give every unit of work exactly one current owner, on Kubernetes.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"tasklease {version()}")
    _add_common(parser, sub=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, handler: Any, example: str, **common: Any) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".",
                           epilog=f"example:\n  {example}\n\n{_SEE_CODES}",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(handler=handler)
        # The operator's -n restricts what it watches (kopf's convention): its own flag.
        _add_common(p, sub=True, namespace=name != "operator", **common)
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
    p.add_argument("--backoff-jitter", action=argparse.BooleanOptionalAction,
                   help="wait a random time between half the backoff and all of it (default on)")
    p.add_argument("--attempt-timeout", type=int, metavar="SECONDS",
                   help="end an attempt that runs longer than this (AttemptTimedOut; spec.attemptTimeoutSeconds)")
    p.add_argument("--deadline", help="RFC 3339 time after which the task fails (DeadlineExceeded)")
    p.add_argument("--not-before", help="RFC 3339 time before which no attempt starts (a delayed start)")
    p.add_argument("--ttl", type=int, dest="ttl", metavar="SECONDS",
                   help="delete the task this long after it finishes (spec.ttlSecondsAfterFinished)")

    p = command("list", "list tasks, as a table or in another format; --watch follows changes", cmd_list,
                "tasklease list --queue emails --phase Failed -o wide")
    p.add_argument("--queue", type=_queue, help="only this queue (filtered by the API server)")
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
    p.add_argument("--wait", type=_seconds, default=0, help="seconds to wait for a task (default: do not wait)")
    p.add_argument("--format", choices=["json", "env"], default="json",
                   help="json, or shell `export` lines for eval "
                        "(TASKLEASE_TASK, _NAMESPACE, _EPOCH, _HOLDER, _PAYLOAD)")
    p.add_argument("--pod-bound", action="store_true",
                   help="the operator renews the lease while this Pod runs and its containers do not restart: "
                        "no `tasklease renew` loop (needs POD_UID or the Pod's token, and the Pod label "
                        "tasklease.dev/agent=true; docs/pod-bound.md)")

    for name, help, handler, example in (
            ("renew", "renew a held lease", cmd_renew,
             "tasklease renew  # uses $TASKLEASE_TASK/_NAMESPACE/_HOLDER/_EPOCH"),
            ("complete", "complete a held task with a result", cmd_complete, "tasklease complete --result done"),
            ("fail", "fail the current attempt (retried with backoff unless --final)", cmd_fail,
             "tasklease fail -m 'upstream said 503'"),
            ("release", "give a held task back at once, without backoff", cmd_release, "tasklease release")):
        p = command(name, help, handler, example,
                    namespace_default="$TASKLEASE_NAMESPACE, else the kubeconfig context's or the pod's")
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
    p.add_argument("--queue", type=_queue, help="every Failed task of this queue")
    p.add_argument("-l", "--selector", default="", help="only Failed tasks with these labels")
    p.add_argument("--reason", help="only Failed tasks with this status.reason, e.g. DeadLettered")

    for name, help, handler in (
            ("pause", "stop agents claiming from a queue (creates its TaskQueue if missing); running tasks go on",
             cmd_pause),
            ("resume", "let agents claim from a paused queue again", cmd_resume)):
        p = command(name, help, handler, f"tasklease {name} emails")
        p.add_argument("queue", type=_queue, help="the queue (its TaskQueue has its name)")

    p = command("top", "a live view of the queues: counts, rates, oldest pending, slowest running, holders",
                cmd_top, "tasklease top -A")
    p.add_argument("-A", "--all-namespaces", action="store_true", help="every namespace")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit (for scripts)")

    p = command("run", "claim a task, run CMD for it, complete on exit 0, fail otherwise", cmd_run,
                "tasklease run --queue emails --loop -- ./send-email.sh")
    p.add_argument("--queue", required=True)
    p.add_argument("--loop", action="store_true", help="keep taking tasks until stopped")
    p.add_argument("--wait", type=_seconds, help="seconds to wait for a task (default: once: none; --loop: forever)")
    p.add_argument("--grace", type=_seconds, default=10.0, help="seconds between SIGTERM and SIGKILL (default 10)")
    p.add_argument("--concurrency", type=_concurrency, default=1, metavar="N",
                   help=f"with --loop: run up to N commands at a time, 1 to {MAX_CONCURRENCY} (default 1)")
    p.add_argument("--drain", action="store_true",
                   help="on SIGTERM, claim no more and let running commands finish within --grace; exit 0")
    p.add_argument("--timeout", type=_seconds, metavar="SECONDS",
                   help="stop the command (SIGTERM, SIGKILL after --grace) once it has run this long and fail "
                        "the attempt, its message starting 'AttemptTimedOut:' (default: the Task's "
                        "attemptTimeoutSeconds; none if it has none)")
    p.add_argument("--metrics-port", type=_port, metavar="PORT",
                   help="serve this agent's Prometheus metrics (claims, completions, failures, lost leases, "
                        "run time) on /metrics at PORT (needs prometheus-client: pip install 'tasklease[metrics]')")
    p.add_argument("--metrics-host", default="0.0.0.0", help="the address --metrics-port listens on (default 0.0.0.0)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ARGS", help="the command to run")

    p = command("completion", "print the shell completion script for bash or zsh", cmd_completion,
                "source <(tasklease completion bash)")
    p.add_argument("shell", choices=sorted(completion.SHELLS))

    p = command("operator", "run the operator (kopf): status, expiry, requeue, dead letters, cleanup",
                cmd_operator, "tasklease operator --namespace shop --no-leader-elect")
    from tasklease.operator.options import add_operator_arguments

    add_operator_arguments(p)
    return parser


# -- handlers -----------------------------------------------------------------------


def cmd_top(args: argparse.Namespace) -> int:
    from tasklease.cli import top

    kube = kube_of(args)
    return top.run(kube, namespace=None if args.all_namespaces else kube.namespace, once=args.once)


def cmd_completion(args: argparse.Namespace) -> int:
    print(completion.SHELLS[args.shell](build_parser()), end="")
    return 0


def cmd_operator(args: argparse.Namespace) -> int:
    try:
        from tasklease.operator.controller import run_operator
    except ModuleNotFoundError as exc:  # kopf or prometheus-client: the `operator` extra
        if exc.name not in ("kopf", "prometheus_client"):
            raise
        raise errors.TaskleaseError(f"the operator needs {exc.name}: pip install 'tasklease[operator]'") from exc

    if getattr(args, "namespace", None) and not args.namespaces:  # `tasklease -n NS operator`
        args.namespaces = [args.namespace]
    # kopf reads events with json, which recurses once per level: on 3.11 this limit bounds how
    # deep a Task it can read (the API server stores up to 10,000 levels). Our process, not a library's.
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 30_000))
    return run_operator(args)


# -- helpers ------------------------------------------------------------------------------


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value and value.isdigit() else None


if __name__ == "__main__":
    raise SystemExit(main())

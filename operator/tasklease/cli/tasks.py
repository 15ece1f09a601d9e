"""`tasklease` commands that manage tasks: submit, list, get, describe, cancel, requeue, retry."""

from __future__ import annotations

import argparse
import json
import queue
import sys
from typing import Any

import yaml

from tasklease.agent.producer import same_spec
from tasklease.api import errors, models
from tasklease.cli import output
from tasklease.cli.common import first_line, kube_of, read_text
from tasklease.kube import EVENTS, TASKS, Kube
from tasklease.kube.watching import Reflector
from tasklease.protocol import Protocol, TaskView
from tasklease.protocol.labels import labelled


def cmd_submit(args: argparse.Namespace) -> int:
    """Each task is reported on its own line and the others go on: a name that exists with the
    same spec is the same task submitted again (names are idempotency keys), exit 0; one that
    exists with another spec, or is refused, is named and makes the exit code non-zero."""
    bodies = _task_files(args.filename) if args.filename else [("--queue and the flags", _task_from_flags(args))]
    kube = kube_of(args)
    worst = 0
    for where, body in bodies:
        meta = body.get("metadata") if isinstance(body, dict) else None
        name = str(meta.get("name") or "") if isinstance(meta, dict) else ""
        try:
            _check(body, where)
            namespace = (meta or {}).get("namespace") or kube.namespace
            created = kube.create(TASKS, labelled(body), namespace=namespace)
            print(f"task/{created['metadata']['name']} created")
        except errors.Conflict:
            existing = kube.get(TASKS, name, namespace=namespace)
            if same_spec(existing.get("spec") or {}, body.get("spec") or {}):
                print(f"task/{name} unchanged (already submitted)")
                continue
            print(f"tasklease: task/{name} already exists with another spec; left as it is", file=sys.stderr)
            worst = max(worst, errors.Conflict.exit_code)
        except errors.TaskleaseError as exc:
            print(f"tasklease: task/{name or '?'}: {first_line(str(exc))}", file=sys.stderr)
            worst = max(worst, exc.exit_code)
    return worst


def cmd_list(args: argparse.Namespace) -> int:
    kube = kube_of(args)
    field = f"spec.queue={args.queue}" if args.queue else ""
    listed = kube.list(TASKS, all_namespaces=args.all_namespaces, label_selector=args.selector,
                       field_selector=field)
    items = sorted((t for t in listed["items"] if _phase_matches(t, args.phase)),
                   key=lambda t: (t["metadata"]["namespace"], t["metadata"]["creationTimestamp"]))
    text = output.render(items, args.output, single=False, all_namespaces=args.all_namespaces)
    if text or args.output in ("json", "yaml"):
        print(text, flush=True)
    elif not args.watch and not items:
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
    # Printed here, not in the watch's thread: a closed pipe (`| head`) must end this command.
    events: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
    watch = Reflector(kube, TASKS, namespace=None if args.all_namespaces else kube.namespace,
                      listener=lambda kind, obj: events.put((kind, obj)), label_selector=args.selector,
                      field_selector=f"spec.queue={args.queue}" if args.queue else "", since=resource_version)
    watch.start()
    try:
        while True:  # until Ctrl-C, a closed pipe, or a permanent error
            try:
                show(*events.get(timeout=1.0))
            except queue.Empty:
                if watch.stopped:
                    raise watch.error or errors.Unreachable("the watch of tasks stopped") from None
    finally:
        watch.stop()


def cmd_get(args: argparse.Namespace) -> int:
    task = kube_of(args).get(TASKS, args.name)
    print(output.render([task], args.output, single=True))
    return 0


def cmd_describe(args: argparse.Namespace) -> int:
    kube = kube_of(args)
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
        if rec.budget_from:
            print(f"Retried:    {spec.get('maxAttempts', 3)} more attempts counted from attempt {rec.budget_from + 1}")
    if spec.get("notBefore"):
        print(f"Starts:     not before {spec['notBefore']}")
    if spec.get("attemptTimeoutSeconds") is not None:
        print(f"Timeout:    each attempt ends AttemptTimedOut after {spec['attemptTimeoutSeconds']}s")
    if spec.get("ttlSecondsAfterFinished") is not None:
        print(f"Cleanup:    deleted {spec['ttlSecondsAfterFinished']}s after it finishes")
    if status.result:
        print(f"Result:     {first_line(status.result)}")
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


def cmd_cancel(args: argparse.Namespace) -> int:
    kube = kube_of(args)
    task = kube.merge_patch(TASKS, args.name, {"spec": {"cancel": True}})
    phase = (task.get("status") or {}).get("phase")
    # The request stays on the Task either way; a finished one has nothing left to cancel.
    print(f"task/{args.name} already {phase}: nothing to cancel" if phase in models.TERMINAL_PHASES
          else f"task/{args.name} cancel requested")
    return 0


def cmd_requeue(args: argparse.Namespace) -> int:
    kube = kube_of(args)
    protocol = Protocol(kube)
    task = TaskView.of(kube.get(TASKS, args.name))
    protocol.requeue(task, protocol.read(kube.namespace, args.name), message="requeued by tasklease requeue")
    print(f"task/{args.name} requeued")
    return 0


def cmd_retry(args: argparse.Namespace) -> int:
    """Redrive: each Failed task gets maxAttempts more claims (one Lease write each); the
    operator then projects it back to Pending and agents claim it. Reports every task."""
    selects = bool(args.queue or args.selector or args.reason)
    if args.names and selects:
        raise errors.BadArguments("retry takes task names or --queue/-l/--reason, not both")
    if not args.names and not selects:
        raise errors.BadArguments("retry needs task names, or --queue, -l or --reason to select Failed tasks")
    kube = kube_of(args)
    protocol = Protocol(kube)
    if args.names:
        tasks = [kube.get(TASKS, name) for name in args.names]
    else:
        field = ",".join([f"status.phase={models.Phase.FAILED.value}", *([f"spec.queue={args.queue}"]
                                                                      if args.queue else [])])
        tasks = [t for t in kube.list(TASKS, label_selector=args.selector, field_selector=field)["items"]
                 if args.reason is None or (t.get("status") or {}).get("reason") == args.reason]
    worst = 0
    for task in sorted(tasks, key=lambda t: t["metadata"]["name"]):
        view = TaskView.of(task)
        try:
            rec = protocol.retry(view, protocol.read(view.namespace, view.name))
        except errors.TaskleaseError as exc:
            print(f"tasklease: {first_line(str(exc))}", file=sys.stderr)
            worst = max(worst, exc.exit_code)
            continue
        print(f"task/{view.name} retried: up to {view.spec.max_attempts} more attempts from attempt {rec.epoch + 1}")
    if not tasks:
        print("no Failed task matched", file=sys.stderr)
    return worst


def _task_from_flags(args: argparse.Namespace) -> dict[str, Any]:
    if not args.queue:
        raise errors.BadArguments("submit needs --queue (or -f FILE)")
    payload: Any = {}
    try:
        text = read_text(args.payload_file) if args.payload_file else args.payload
        if text:
            payload = json.loads(text, parse_constant=_not_json)
    except ValueError as exc:
        raise errors.Invalid(f"payload is not valid JSON: {exc}") from None
    except RecursionError:
        raise errors.Invalid(f"the payload nests deeper than {models.MAX_PAYLOAD_DEPTH} levels") from None
    spec: dict[str, Any] = {"queue": args.queue, "payload": payload}
    for flag, field in (("priority", "priority"), ("max_attempts", "maxAttempts"),
                        ("lease_duration", "leaseDurationSeconds"), ("deadline", "deadline"),
                        ("not_before", "notBefore"), ("ttl", "ttlSecondsAfterFinished"),
                        ("attempt_timeout", "attemptTimeoutSeconds")):
        if getattr(args, flag) is not None:
            spec[field] = getattr(args, flag)
    backoff = {k: v for k, v in (("initialSeconds", args.backoff_initial), ("maxSeconds", args.backoff_max),
                                 ("policy", args.backoff_policy), ("jitter", args.backoff_jitter)) if v is not None}
    if backoff:
        spec["backoff"] = backoff
    if args.name == "":
        raise errors.BadArguments("--name is empty: give the task's name (its idempotency key), or leave the flag out")
    meta = {"name": args.name} if args.name else {"generateName": f"{args.queue}-"}
    return {"apiVersion": f"{models.GROUP}/{models.VERSION}", "kind": models.KIND, "metadata": meta, "spec": spec}


def _not_json(constant: str) -> Any:
    """What Python's json reads and JSON has not: NaN, Infinity, -Infinity."""
    raise ValueError(f"{constant} is not JSON")


def _task_files(paths: list[str]) -> list[tuple[str, Any]]:
    """(where each document is, the document) of every file, as read: `_check` judges them."""
    docs: list[tuple[str, Any]] = []
    for path in paths:
        text = read_text(path)
        try:
            docs += [(f"document {i} of {path}", d) for i, d in enumerate(yaml.safe_load_all(text), 1) if d]
        except yaml.YAMLError as exc:
            raise errors.Invalid(f"cannot read {path}: {first_line(str(exc))}") from None
        except RecursionError:
            raise errors.Invalid(f"cannot read {path}: it nests deeper than a Task can") from None
    if not docs:
        raise errors.Invalid(f"no Task in {', '.join(paths)}: nothing submitted")
    return docs


def _check(body: Any, where: str) -> None:
    """A Task as submitted: an object whose metadata and spec are objects, its payload an
    object no deeper than every reader reads (a deeper one is refused before it exists, not found
    unclaimable later)."""
    if not isinstance(body, dict) or not all(isinstance(body.get(k) or {}, dict) for k in ("metadata", "spec")):
        raise errors.Invalid(f"{where} is not a Task object")
    try:
        # What YAML reads and JSON cannot say (a date, binary, NaN, an anchor that holds itself),
        # and Python's json would otherwise send as it is (NaN, Infinity): refused here, by name.
        json.dumps(body, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise errors.Invalid(f"{where} is not JSON: {first_line(str(exc))}") from None
    namespace = (body.get("metadata") or {}).get("namespace")
    if namespace is not None and not models.is_namespace(namespace):
        raise errors.Invalid(f"{where}: {namespace!r} is not a namespace name")
    spec = body.get("spec") or {}
    depth = models.payload_depth(spec.get("payload"))
    if depth > models.MAX_PAYLOAD_DEPTH:
        raise errors.Invalid(f"{where}: the payload nests {depth} levels deep, more than {models.MAX_PAYLOAD_DEPTH}")
    if "payload" in spec and not isinstance(spec["payload"], dict):  # the API server drops a null: {} instead
        raise errors.Invalid(f"{where}: the payload must be a JSON object, not {json.dumps(spec['payload'])[:40]}")

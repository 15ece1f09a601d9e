"""An agent's memory and import cost, in seconds, without an API server.

`python -m tasklease_dev.agentmem [--tasks N]` prints, each measured in a fresh process:
what importing an agent costs (peak RSS and CPU of `import tasklease.agent.sdk` and of the
CLI's module), and what a QueueView holding N open tasks costs: N Tasks as the API server
lists them (uid, creationTimestamp, resourceVersion, managedFields, the rank label, the
spec and the status with the CRD's defaults filled in), fed through the Task watch's own list
path in pages of 500 decoded from JSON bytes, as `Kube.list_pages` reads them (keys in the
API server's order: a custom resource's `items` come before the list's `metadata`), then
listed again as after a streaming list the API server cut short.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

NAMESPACE = "bench"
QUEUE = "bench"
_PAGE = 500


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def task_json(i: int, start: datetime) -> dict[str, Any]:
    """Task `i` as the API server lists it: created a few per millisecond, defaults applied, not
    yet claimed."""
    created = (start + timedelta(milliseconds=i // 4)).strftime("%Y-%m-%dT%H:%M:%SZ")
    name = f"bench-{i:06d}"
    return {
        "apiVersion": "tasklease.dev/v1alpha1", "kind": "Task",
        "metadata": {
            "creationTimestamp": created, "generation": 1,
            "labels": {"tasklease.dev/rank": "1000"},
            "managedFields": [{
                "apiVersion": "tasklease.dev/v1alpha1", "fieldsType": "FieldsV1",
                "fieldsV1": {"f:metadata": {"f:labels": {".": {}, "f:tasklease.dev/rank": {}}},
                             "f:spec": {".": {}, "f:payload": {".": {}, "f:i": {}}, "f:queue": {}}},
                "manager": "python", "operation": "Update", "time": created}],
            "name": name, "namespace": NAMESPACE, "resourceVersion": str(100000 + i),
            "uid": str(uuid.UUID(int=(0x5EED << 100) + i)),
        },
        "spec": {"backoff": {"initialSeconds": 5, "jitter": True, "maxSeconds": 300, "policy": "Exponential"},
                 "cancel": False, "leaseDurationSeconds": 30, "maxAttempts": 3, "payload": {"i": i},
                 "priority": 0, "queue": QUEUE},
        "status": {"attempt": 0, "holder": "", "lastError": "", "observedGeneration": 0, "phase": "Pending",
                   "reason": "", "result": ""},
    }


class PagedKube:
    """The Kube a QueueView needs for a paginated first list: pages of Tasks, decoded from bytes (the
    streaming list an agent makes decodes one Task at a time, as its pages do)."""

    namespace = NAMESPACE

    def __init__(self, tasks: int) -> None:
        self.tasks = tasks
        self.start = datetime(2026, 1, 1, tzinfo=UTC)

    def list_pages(self, res: Any, **kwargs: Any) -> Iterator[dict[str, Any]]:
        from tasklease.kube import decode  # what the client decodes with
        unsharded = "notin" in kwargs.get("label_selector", "")  # the only watch that selects these tasks
        for first in range(0, self.tasks if unsharded else 0, _PAGE):
            # One task at a time, as an answer's bytes arrive: nothing but the bytes outlives this.
            items = b",".join(json.dumps(task_json(i, self.start)).encode()
                              for i in range(first, min(first + _PAGE, self.tasks)))
            data = (b'{"apiVersion":"tasklease.dev/v1alpha1","items":[' + items +
                    b'],"kind":"TaskList","metadata":{"resourceVersion":"99999"}}')
            yield decode.loads_page(data) if kwargs.get("stream") else decode.loads(data)

    def now(self) -> datetime:
        return datetime.now(UTC)


def _fill(tasks: int, top: int) -> dict[str, Any]:
    """In this process: a QueueView's first list of `tasks` Tasks; its memory before and after."""
    import tracemalloc

    from tasklease.agent.discovery import QueueView
    base, cpu = _status_mb("VmRSS"), time.process_time()
    if top:
        tracemalloc.start(5)
    view = QueueView(PagedKube(tasks), namespace=NAMESPACE, queue=QUEUE)  # type: ignore[arg-type]
    _relist(view)
    out: dict[str, Any] = {"tasks": tasks, "claimable": view.claimable_count(), "rss_before_mb": base,
                           "rss_after_mb": _status_mb("VmRSS"), "hwm_mb": _status_mb("VmHWM"),
                           "cpu_s": time.process_time() - cpu}
    out["bytes_per_task"] = (out["rss_after_mb"] - base) * 2**20 / max(tasks, 1)
    if top:
        out.update(allocations(top, tasks))
    # Listed again, as after a streaming list the API server cut short: its peak is the agent's.
    _relist(view)
    out.update(relisted=view.claimable_count(), relist_hwm_mb=_status_mb("VmHWM"))
    return out


def _relist(view: Any) -> None:
    """The view's Task watches list (the tasks have the default rank and no shard: the watch
    every agent keeps takes them all, the most an agent holds)."""
    for r in view.task_watch.reflectors():
        r._relist()


def allocations(top: int, tasks: int) -> dict[str, Any]:
    """What tracemalloc (started by the caller) finds still held: the `top` largest sites, and in all."""
    import tracemalloc
    snapshot = tracemalloc.take_snapshot()
    traced = sum(s.size for s in snapshot.statistics("filename"))
    return {"top": [str(s) for s in snapshot.statistics("lineno")[:top]], "traced_mb": traced / 2**20,
            "traced_bytes_per_task": traced / max(tasks, 1)}


def print_allocations(got: dict[str, Any]) -> None:
    for line in got.get("top", []):
        print("  " + line)
    if "traced_mb" in got:
        print(f"  traced at the end: {got['traced_mb']:.1f} MB, {got['traced_bytes_per_task']:.0f} B/task")


def _imported(module: str) -> dict[str, Any]:
    cpu = time.process_time()
    __import__(module)
    return {"module": module, "cpu_s": time.process_time() - cpu, "hwm_mb": _status_mb("VmHWM"),
            "modules": len(sys.modules)}


def child_report(module: str, *args: str) -> dict[str, Any]:
    """What `python -m <module> <args>` (a probe's child, in a fresh process) printed last, as JSON."""
    out = subprocess.run([sys.executable, "-m", module, *args], check=True, capture_output=True, text=True).stdout
    result: dict[str, Any] = json.loads(out.splitlines()[-1])
    return result


def _child(*args: str) -> dict[str, Any]:
    return child_report("tasklease_dev.agentmem", *args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tasklease_dev.agentmem", description=__doc__)
    parser.add_argument("--tasks", type=int, default=100_000, help="open tasks in the queue (default 100,000)")
    parser.add_argument("--top", type=int, default=0, help="also trace allocations: the N largest sites")
    parser.add_argument("--import", dest="module", help=argparse.SUPPRESS)  # in the child
    parser.add_argument("--fill", action="store_true", help=argparse.SUPPRESS)  # in the child
    args = parser.parse_args(argv)
    if args.module:
        print(json.dumps(_imported(args.module)))
        return 0
    if args.fill:
        print(json.dumps(_fill(args.tasks, args.top)))
        return 0
    baseline = _child("--import", "json")
    for module in ("tasklease.agent.sdk", "tasklease.cli.main"):
        got = _child("--import", module)
        print(f"import {module}: peak {got['hwm_mb']:.1f} MB ({got['hwm_mb'] - baseline['hwm_mb']:+.1f} over "
              f"a bare interpreter), {got['cpu_s']:.2f} s CPU, {got['modules']} modules")
    got = _child("--fill", "--tasks", str(args.tasks), "--top", str(args.top))
    print(f"QueueView of {got['tasks']:,} tasks ({got['claimable']:,} claimable): RSS {got['rss_before_mb']:.1f} -> "
          f"{got['rss_after_mb']:.1f} MB, {got['bytes_per_task']:.0f} B/task, peak {got['hwm_mb']:.1f} MB, "
          f"{got['cpu_s']:.1f} s CPU")
    print_allocations(got)
    print(f"listed again (a streaming list cut short): peak {got['relist_hwm_mb']:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A namespace of its own for each case, and the Tasks a case starts from.

Tasks are created by parallel raw POSTs: from several processes for deep queues, as the
bench's own Python would otherwise bound how fast a 100,000-task queue fills.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from tasklease.kube import LEASES, NAMESPACES, TASKS, Kube
from tasklease.protocol import record
from tasklease.protocol.labels import labelled
from tasklease_dev.cluster import namespaced_kubeconfig

T = TypeVar("T")
_THREADS = 16  # concurrent POSTs per creating process
_PER_PROCESS = 5000  # tasks below this many are created by the bench's own process


@contextlib.contextmanager
def namespace(kubeconfig: Path) -> Iterator[Kube]:
    """A client in a namespace of its own, deleted (and gone) afterwards."""
    admin = Kube.connect(kubeconfig=str(kubeconfig))
    name = f"bench-{uuid.uuid4().hex[:6]}"
    admin.create(NAMESPACES, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    try:
        yield Kube.connect(kubeconfig=str(kubeconfig), namespace=name, pool_size=64)
    finally:
        # Gone before the next case starts: deleting what a case made (100,000 Tasks, say)
        # costs the control plane about what making it did, and must not weigh on the next.
        began = time.monotonic()
        admin.delete(NAMESPACES, name)
        deadline = began + 3600
        while admin.get_or_none(NAMESPACES, name) is not None and time.monotonic() < deadline:
            time.sleep(0.5)
        if time.monotonic() - began > 10:
            print(f"namespace {name} and what the case made deleted in {time.monotonic() - began:.0f} s",
                  file=sys.stderr, flush=True)


def in_namespace(kubeconfig: Path, body: Callable[[Kube], T]) -> T:
    with namespace(kubeconfig) as kube:
        return body(kube)


def namespace_config(kube: Kube, kubeconfig: Path) -> Path:
    """A kubeconfig for `kube`'s namespace beside `kubeconfig` (removed with the bench's folder)."""
    return namespaced_kubeconfig(kubeconfig, kube.namespace, kubeconfig.parent / f"{kube.namespace}.kubeconfig")


def task_body(name: str, *, queue: str, **spec: Any) -> dict[str, Any]:
    """A Task as producers create it (with its rank label, which the one-shot claim climbs by)."""
    return labelled({"apiVersion": "tasklease.dev/v1alpha1", "kind": "Task", "metadata": {"name": name},
                     "spec": {"queue": queue, **spec}})


def create(kube: Kube, name: str, *, queue: str, **spec: Any) -> None:
    kube.create(TASKS, task_body(name, queue=queue, **spec))


# The operator-on case's 16 agents also spread over these many queues, two to a queue and one:
# what one queue's work split in several costs (docs/sizing.md), beside the same work in one
# queue; one agent a queue is as far as dividing a queue's watches among its agents could go.
SPREADS = (8, 16)


def _spread_suffix(queues: int) -> str:
    """What a figure's key ends with when its case spreads its work over `queues` queues."""
    return "" if queues == 1 else f"_over_{queues}_queues"


# The operator-on section's cases: (agents, queues they spread over).
OPERATOR_ON_CASES = ((8, 1), (16, 1), *((16, queues) for queues in SPREADS))


def spread_words(agents: int, queues: int) -> str:
    """How tables name an operator-on case: its agents, and the queues they spread over."""
    return f"{agents} over {queues} queues" if queues > 1 else f"{agents} agents"


def operator_on_case(agents: int, queues: int) -> str:
    """Where the operator-on section keeps a case's runs in a result file (its `cases`)."""
    return f"operator-on-{agents}{_spread_suffix(queues).replace('_', '-')}"


def operator_on_figure(agents: int, queues: int) -> str:
    """The key of a case's figure: its SDK's rate ÷ the 3-write floor's."""
    return f"sdk_operator_on_vs_floor3_{agents}{_spread_suffix(queues)}"


# The `objects` section: the 3-write floor's writes made with the product's objects.
OBJECTS_WORKERS = 16
OBJECTS_CASE = f"objects-{OBJECTS_WORKERS}"  # where its runs are kept in a result file (its `cases`)
OBJECTS_FIGURE = f"objects3_vs_floor3_{OBJECTS_WORKERS}"  # their rate ÷ the 3-write floor's


def operator_on_events(queues: int) -> str:
    """The key of the watch events per task per agent of the cases over `queues` queues."""
    return f"events_per_task_per_agent_operator_on{_spread_suffix(queues)}"


def queue_of(queue: str, index: int, queues: int) -> str:
    """The queue of task (or worker) number `index` of a case that spreads its work over
    `queues` queues: `queue` itself when there is one, else `<queue>-<index mod queues>`."""
    return queue if queues == 1 else f"{queue}-{index % queues}"


def create_range(kube: Kube, start: int, stop: int, *, queue: str, queues: int = 1, **spec: Any) -> None:
    """Tasks t-<start> .. t-<stop - 1> (spread over `queues` queues, `queue_of`), `_THREADS` POSTs at a time."""
    with concurrent.futures.ThreadPoolExecutor(_THREADS) as pool:
        list(pool.map(lambda i: create(kube, f"t-{i:06d}", queue=queue_of(queue, i, queues), **spec),
                      range(start, stop)))


def create_tasks(kube: Kube, count: int, *, queue: str, queues: int = 1, kubeconfig: Path | None = None,
                 processes: int = 4, **spec: Any) -> None:
    """`count` Tasks t-000000 ... (over `queues` queues, `queue_of`); with `kubeconfig` and many
    tasks, from `processes` processes."""
    if kubeconfig is None or count < _PER_PROCESS:
        create_range(kube, 0, count, queue=queue, queues=queues, **spec)
        return
    config = namespace_config(kube, kubeconfig)
    bounds = [count * i // processes for i in range(processes + 1)]
    procs = [subprocess.Popen([sys.executable, "-m", "tasklease_dev.bench.space", str(config), queue,
                               str(queues), str(lo), str(hi), json.dumps(spec)])
             for lo, hi in zip(bounds, bounds[1:], strict=False)]
    failed = [proc for proc in procs if proc.wait() != 0]
    if failed:
        raise RuntimeError(f"bench: {len(failed)} of {processes} task-creating processes failed")


def lease_state(kube: Kube, name: str) -> str:
    obj = kube.get_or_none(LEASES, name)
    return record.decode(obj).state if obj else ""


def lease_holder(kube: Kube, name: str) -> str:
    obj = kube.get_or_none(LEASES, name)
    return str(((obj or {}).get("spec") or {}).get("holderIdentity") or "")


def phase_is(kube: Kube, name: str, phase: str) -> bool:
    return bool((kube.get(TASKS, name).get("status") or {}).get("phase") == phase)


if __name__ == "__main__":  # one creating process of `create_tasks`
    _config, _queue, _queues, _lo, _hi, _spec = sys.argv[1:]
    create_range(Kube.connect(kubeconfig=_config, pool_size=_THREADS), int(_lo), int(_hi), queue=_queue,
                 queues=int(_queues), **json.loads(_spec))

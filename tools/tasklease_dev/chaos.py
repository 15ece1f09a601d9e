"""`make chaos`: a fleet under random faults, then proof from the evidence that no promise broke.

Load: tasks (a few of them poison: their command always fails) on one queue, `tasklease run
--loop` agents, two operators with leader election, all on a local control plane of its own.
Faults, at random until every task is terminal: agent kill -9 (restarted under the same
or a new pod name), SIGSTOP of an agent that holds a task until the operator has expired it,
kill -9 of the leading operator, kill -9 of kube-apiserver (restarted by `LocalCluster.restart`).

Evidence: each command appends `start`/`end` lines to an execution log, and the API
server's audit log holds every Lease write with its answer. Checked:
every task terminal and none missing; no epoch held by two holders; every Succeeded
result written by the holder of the final epoch; no stale write accepted (a write whose
precondition is older than a version already accepted); poison tasks dead-lettered at
exactly maxAttempts; at most one accepted completion per task; each fault's effect (an
expiry, a new leader) within 60 s; every agent's documented exit code on SIGTERM; no
traceback in any log, read once every process has stopped. Exit status 1 on any violation.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasklease.api import errors
from tasklease.api.timestamps import parse_time
from tasklease_dev.cluster import LocalCluster, audit_files, free_port, stop_on_sigterm
from tasklease_dev.crds import apply_crds
from tasklease.kube import LEASES, NAMESPACES, TASKS, Kube
from tasklease.protocol import LeaseRecord, members, record

NAMESPACE = "chaos"
QUEUE = "chaos"
LEASE_S = 5
STOPPED = 143  # `tasklease run`'s documented exit code when SIGTERM stops it
POISON_ATTEMPTS = 3
NORMAL_ATTEMPTS = 30  # faults alone must not dead-letter a healthy task
FAULTS = ["agent-kill-same", "agent-kill-new", "agent-stop", "leader-kill", "apiserver-kill"]
WORKER = r"""
echo "start $TASKLEASE_TASK $TASKLEASE_EPOCH $TASKLEASE_HOLDER" >> "$CHAOS_EXEC_LOG"
case "$TASKLEASE_PAYLOAD" in *poison*) exit 1;; esac
sleep "$CHAOS_WORK_S"
echo "end $TASKLEASE_TASK $TASKLEASE_EPOCH $TASKLEASE_HOLDER" >> "$CHAOS_EXEC_LOG"
echo "$TASKLEASE_TASK:$TASKLEASE_EPOCH"
"""


@dataclass
class Proc:
    name: str
    argv: list[str]
    log: Path
    env: dict[str, str]
    popen: subprocess.Popen[bytes] | None = None
    port: int = 0

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.popen = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env={**os.environ, **self.env}, start_new_session=True)

    def signal(self, sig: int) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        if self.popen is not None:
            self.popen.wait(30)

    def stop(self) -> int | None:
        """SIGTERM (SIGKILL 20 s later); its exit code (None: never started)."""
        if self.popen is None or self.popen.poll() is not None:
            return self.popen.returncode if self.popen else None
        self.popen.send_signal(signal.SIGCONT)
        self.popen.send_signal(signal.SIGTERM)
        try:
            return self.popen.wait(20)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.popen.returncode

    def readyz(self) -> str:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readyz", timeout=2) as resp:
                return str(resp.read().decode())
        except urllib.error.HTTPError as exc:  # 503: not ready, and the body says in which role
            return str(exc.read().decode())
        except OSError:
            return ""


@dataclass
class Figures:
    faults: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    kill_to_requeue_s: list[float] = field(default_factory=list)
    takeover_s: list[float] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)


class Chaos:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.workdir = Path(args.workdir).resolve()
        self.cluster = LocalCluster(self.workdir / "cluster")
        self.logs = self.workdir / "logs"
        self.exec_log = self.workdir / "exec.log"
        self.figures = Figures()
        self.agents: list[Proc] = []
        self.operators: list[Proc] = []
        self.kills: list[tuple[float, str]] = []  # (wall time, holder prefix) of killed agents
        # Every kind of fault once, in random order, then at random.
        self.planned = self.rng.sample(FAULTS, len(FAULTS))
        self.kube: Kube
        self.kubeconfig = ""

    # -- set-up --------------------------------------------------------------------------

    def setup(self) -> None:
        self.cluster.down()
        self.logs.mkdir(parents=True, exist_ok=True)
        for old in self.logs.glob("*.log"):  # a previous run's logs are not this run's evidence
            old.unlink()
        self.exec_log.write_text("")
        state = self.cluster.up()
        self.kubeconfig = state.kubeconfig
        apply_crds(kubeconfig=Path(state.kubeconfig), folder=Path(__file__).resolve().parents[2] / "crds")
        self.kube = Kube.connect(kubeconfig=state.kubeconfig, namespace=NAMESPACE, pool_size=32)
        self.kube.create(NAMESPACES, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        poison = set(self.rng.sample(range(self.args.tasks), self.args.poison))
        for i in range(self.args.tasks):
            spec: dict[str, Any] = {"queue": QUEUE, "leaseDurationSeconds": LEASE_S,
                                    "backoff": {"initialSeconds": 0, "maxSeconds": 1},
                                    "maxAttempts": POISON_ATTEMPTS if i in poison else NORMAL_ATTEMPTS,
                                    "payload": {"poison": True} if i in poison else {"n": i}}
            self._retry(lambda spec=spec, i=i: self.kube.create(TASKS, {
                "apiVersion": "tasklease.dev/v1alpha1", "kind": "Task", "metadata": {"name": f"t-{i:05d}"},
                "spec": spec}))
        for i in range(self.args.operators):
            port = free_port()
            op = Proc(f"operator-{i}", self._cli("operator", f"--namespace={NAMESPACE}",
                                                 f"--leader-election-namespace={NAMESPACE}", f"--http-port={port}",
                                                 "--http-host=127.0.0.1", "--grace=1",
                                                 "--leader-election-lease-duration=6"),
                      self.logs / f"operator-{i}.log", {}, port=port)
            op.start()
            self.operators.append(op)
        for i in range(self.args.agents):
            self.agents.append(self._agent(f"agent-{i}"))

    def _cli(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "tasklease.cli", *args[:1], f"--kubeconfig={self.kubeconfig}", *args[1:]]

    def _agent(self, pod: str) -> Proc:
        agent = Proc(pod, self._cli("run", "--queue", QUEUE, f"--namespace={NAMESPACE}", "--loop", "--grace=2",
                                    "--", "sh", "-c", WORKER),
                     self.logs / f"{pod}.log", {"POD_NAME": pod, "CHAOS_EXEC_LOG": str(self.exec_log),
                                                "CHAOS_WORK_S": str(self.args.work_s)})
        agent.start()
        return agent

    @staticmethod
    def _retry(call: Any) -> Any:
        for attempt in range(60):
            try:
                return call()
            except (errors.Unreachable, errors.ServerError):
                time.sleep(min(0.2 * 2 ** attempt, 2))
        raise RuntimeError("the API server did not come back")

    # -- faults ----------------------------------------------------------------------------

    def run(self) -> None:
        deadline = time.monotonic() + self.args.timeout
        next_fault = time.monotonic() + 10  # the fleet at work first
        while not self._all_terminal() or self.planned:  # every kind of fault at least once
            if time.monotonic() > deadline:
                self.figures.violations.append(f"not every task terminal after {self.args.timeout:.0f}s")
                return
            for i, agent in enumerate(self.agents):
                code = agent.popen.poll() if agent.popen else None
                if code is not None:  # exited by itself: `run --loop` must survive faults
                    self.figures.violations.append(f"{agent.name} exited with code {code}")
                    self.agents[i] = self._agent(agent.name)
            if time.monotonic() >= next_fault:
                self._fault()
                next_fault = time.monotonic() + self.rng.uniform(0.5, 1.5) * self.args.fault_every
            time.sleep(1)

    def _all_terminal(self) -> bool:
        try:
            items = self.kube.list(TASKS, namespace=NAMESPACE)["items"]
        except (errors.Unreachable, errors.ServerError):
            return False
        open_ = [t for t in items if (t.get("status") or {}).get("phase") not in ("Succeeded", "Failed", "Cancelled")]
        print(f"chaos: {len(items) - len(open_)}/{len(items)} terminal; faults {dict(self.figures.faults)}",
              flush=True)
        return not open_

    def _fault(self) -> None:
        kind = self.planned.pop() if self.planned else self.rng.choice(FAULTS)
        if kind.startswith("agent-kill"):
            i = self.rng.randrange(len(self.agents))
            victim = self.agents[i]
            assert victim.popen is not None
            self.kills.append((time.time(), _prefix(victim)))
            victim.kill()
            base = victim.name.split("-r")[0]  # a pod name is a DNS label: agent-3, agent-3-r4da17
            pod = victim.name if kind == "agent-kill-same" else f"{base}-r{self.rng.randrange(1 << 20):x}"
            self.agents[i] = self._agent(pod)
        elif kind == "agent-stop":
            # One that holds a task, if any does: the operator must expire it under the agent.
            held = self._held_by()
            victim = self.rng.choice([a for a in self.agents if any(h.startswith(_prefix(a)) for h in held)]
                                     or self.agents)
            victim.signal(signal.SIGSTOP)
            # Resumed once the operator has expired what it held: its late writes must then fail.
            stopped = time.monotonic()
            if not self._leases_let_go(_prefix(victim), deadline_s=60):
                self.figures.violations.append(f"agent-stop: the leases of stopped {victim.name} were "
                                               "not expired within 60s")
            print(f"chaos: {victim.name} stopped for {time.monotonic() - stopped:.1f}s, until it held no lease",
                  flush=True)
            victim.signal(signal.SIGCONT)
        elif kind == "leader-kill":
            found = time.monotonic()
            leader = None
            while leader is None and time.monotonic() - found < 60:  # an election may be under way
                leader = next((op for op in self.operators if _leads(op.readyz())), None)
                time.sleep(0.2)
            if leader is None:
                return
            killed = time.monotonic()
            leader.kill()
            others = [op for op in self.operators if op is not leader]
            while time.monotonic() - killed < 60:
                if any(_leads(op.readyz()) for op in others):
                    self.figures.takeover_s.append(time.monotonic() - killed)
                    break
                time.sleep(0.2)
            else:
                self.figures.violations.append("leader-kill: no other operator took the lead within 60s")
            leader.start()
        else:
            self.cluster.restart("kube-apiserver")
        self.figures.faults[kind] += 1
        print(f"chaos: fault {kind}", flush=True)

    def _held_by(self) -> list[str]:
        """The holders of the tasks held now."""
        held = f"{record.LABEL_STATE}={record.HELD}"
        leases = self._retry(lambda: self.kube.list(LEASES, namespace=NAMESPACE, label_selector=held))["items"]
        return [record.decode(o).holder for o in leases]

    def _leases_let_go(self, prefix: str, *, deadline_s: float) -> bool:
        """Whether, within `deadline_s`, no task is held by a holder starting with `prefix`."""
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if not any(holder.startswith(prefix) for holder in self._held_by()):
                return True
            time.sleep(0.5)
        return False

    # -- evidence ------------------------------------------------------------------------

    def check(self) -> None:
        v = self.figures.violations
        listed = self._retry(lambda: self.kube.list(TASKS, namespace=NAMESPACE))["items"]
        tasks = {t["metadata"]["name"]: t for t in listed}
        missing = self.args.tasks - len(tasks)
        if missing:
            v.append(f"{missing} task(s) missing")
        leases = {o["metadata"]["name"]: record.decode(o)
                  for o in self._retry(lambda: self.kube.list(LEASES, namespace=NAMESPACE))["items"]}
        starts, ends = _exec_log(self.exec_log)
        for name, task in tasks.items():
            status = task.get("status") or {}
            spec = task["spec"]
            rec = leases.get(name)
            poison = bool(spec["payload"].get("poison"))
            if poison:
                if (status.get("phase"), status.get("reason"), status.get("attempt")) != (
                        "Failed", "DeadLettered", spec["maxAttempts"]):
                    v.append(f"{name}: poison task ended {status.get('phase')}/{status.get('reason')} "
                             f"at attempt {status.get('attempt')}, not dead-lettered at {spec['maxAttempts']}")
                continue
            if status.get("phase") != "Succeeded" or rec is None:
                v.append(f"{name}: ended {status.get('phase')}/{status.get('reason')}, not Succeeded")
                continue
            last = rec.history[-1] if rec.history else None
            if (rec.result != f"{name}:{rec.epoch}" or last is None or last.attempt != rec.epoch
                    or last.outcome != "Succeeded" or (name, rec.epoch, last.holder) not in ends):
                v.append(f"{name}: result {rec.result!r} is not from the holder of the final epoch {rec.epoch}")
        holders: dict[tuple[str, int], set[str]] = defaultdict(set)
        for task_name, epoch, holder in starts:
            holders[(task_name, epoch)].add(holder)
        self._replay_audit(holders)
        for (task_name, epoch), who in holders.items():
            if len(who) > 1:
                v.append(f"{task_name}: epoch {epoch} held by {len(who)} holders: {sorted(who)}")

    def _replay_audit(self, holders: dict[tuple[str, int], set[str]]) -> None:
        """Every accepted Lease write, in the order etcd applied them."""
        v = self.figures.violations
        writes = []
        for path in audit_files(self.workdir / "cluster" / "audit.log"):
            for line in path.read_text(errors="replace").splitlines():
                try:
                    event = json.loads(line)
                except ValueError:
                    continue  # a line cut by kill -9
                ref = event.get("objectRef") or {}
                code = (event.get("responseStatus") or {}).get("code", 0)
                if (ref.get("resource") != "leases" or ref.get("namespace") != NAMESPACE or event.get("stage")
                        != "ResponseComplete" or event.get("verb") not in ("create", "patch", "update")
                        or not 200 <= code < 300 or not event.get("responseObject")):
                    continue
                if members.LABEL_AGENT_OF in (event["responseObject"]["metadata"].get("labels") or {}):
                    continue  # an agent telling its peers it works the queue, not a task's Lease
                writes.append(event)
        self.audited_writes = len(writes)
        writes.sort(key=lambda e: int(e["responseObject"]["metadata"]["resourceVersion"]))
        latest: dict[str, int] = {}
        outcome: dict[str, str] = {}
        completions: dict[str, int] = defaultdict(int)
        decoded: list[tuple[float, LeaseRecord]] = []  # (when, the Lease as written), for `kill_to_requeue`
        self.stale_accepted = 0
        for event in writes:
            obj = event["responseObject"]
            name = obj["metadata"]["name"]
            pre = ((event.get("requestObject") or {}).get("metadata") or {}).get("resourceVersion")
            if event["verb"] != "create" and (not pre or int(pre) < latest.get(name, 0)):
                self.stale_accepted += 1
                v.append(f"{name}: a write on version {pre} was accepted after version {latest.get(name)}")
            latest[name] = int(obj["metadata"]["resourceVersion"])
            rec = record.decode(obj)
            decoded.append((_audit_time(event), rec))
            if rec.holder:
                holders[(name, rec.epoch)].add(rec.holder)
            if rec.outcome == "Succeeded" and outcome.get(name) != "Succeeded":
                completions[name] += 1
            outcome[name] = rec.outcome
        self.double_completions = sum(1 for n in completions.values() if n > 1)
        for name, n in completions.items():
            if n > 1:
                v.append(f"{name}: completed {n} times")
        self.figures.kill_to_requeue_s += kill_to_requeue(self.kills, decoded)

    # -- output ------------------------------------------------------------------------------

    def report(self) -> int:
        f = self.figures
        leases_lost = sum(1 for x in f.violations if "missing" in x or "not Succeeded" in x)
        print(f"\nchaos: {self.args.tasks} tasks ({self.args.poison} poison), {self.args.agents} agents, "
              f"{self.args.operators} operators")
        print(f"  faults: {dict(f.faults)}")
        print(f"  audited Lease writes: {getattr(self, 'audited_writes', 0)}")
        print(f"  tasks lost: {leases_lost}; double completions: {getattr(self, 'double_completions', 0)}; "
              f"stale writes accepted: {getattr(self, 'stale_accepted', 0)}")
        if f.kill_to_requeue_s:
            ks = sorted(f.kill_to_requeue_s)
            print(f"  kill -9 to requeue: n={len(ks)} median {ks[len(ks) // 2]:.1f}s max {ks[-1]:.1f}s")
        if f.takeover_s:
            print(f"  leader takeover: n={len(f.takeover_s)} max {max(f.takeover_s):.1f}s")
        for line in f.violations[:50]:
            print(f"  VIOLATION: {line}")
        verdict = f"FAILED: {len(f.violations)} violation(s)" if f.violations else "every invariant held"
        print(f"chaos: {verdict}")
        return 1 if f.violations else 0

    def stop_fleet(self) -> None:
        """Stop every agent and operator, then read their logs whole: a traceback of the last
        fault's aftermath, or of shutting down, is in them only now."""
        for agent in self.agents:
            code = agent.stop()
            if code not in (None, 0, STOPPED):
                self.figures.violations.append(f"{agent.name} exited with code {code} on SIGTERM")
        for op in self.operators:
            op.stop()
        for log in [*self.logs.glob("*.log")]:
            if "Traceback" in log.read_text(errors="replace"):
                self.figures.violations.append(f"a traceback in {log.name}")

    def teardown(self) -> None:
        for p in [*self.agents, *self.operators]:
            p.stop()
        if not self.args.keep:
            self.cluster.down()


def _prefix(agent: Proc) -> str:
    """How the holders of `agent`'s leases begin: its pod name and process id."""
    assert agent.popen is not None
    return f"{agent.name}/{agent.popen.pid}."


def kill_to_requeue(kills: list[tuple[float, str]], writes: list[tuple[float, LeaseRecord]]) -> list[float]:
    """From each agent kill -9 (its time, the prefix of its holders) to the first accepted write,
    by anyone else, of each Lease it held when it died: one whose last write before the kill
    named it the holder (a Lease it had closed or given back before is not its any more)."""
    figures = []
    for killed_at, prefix in kills:
        held: dict[str, bool] = {}
        for when, rec in writes:
            if when < killed_at:
                held[rec.name] = rec.holder.startswith(prefix)
            elif held.get(rec.name) and not rec.holder.startswith(prefix):
                figures.append(when - killed_at)
                held[rec.name] = False
    return figures


def _audit_time(event: dict[str, Any]) -> float:
    when = parse_time(event.get("stageTimestamp"))
    return when.timestamp() if when else 0.0


def _exec_log(path: Path) -> tuple[list[tuple[str, int, str]], set[tuple[str, int, str]]]:
    starts, ends = [], set()
    for line in path.read_text(errors="replace").splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[2].isdigit():
            entry = (parts[1], int(parts[2]), parts[3])
            if parts[0] == "start":
                starts.append(entry)
            elif parts[0] == "end":
                ends.add(entry)
    return starts, ends


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tasklease_dev.chaos", description=__doc__.splitlines()[0])
    p.add_argument("--tasks", type=int, default=1000)
    p.add_argument("--poison", type=int, default=10, help="tasks whose command always fails")
    p.add_argument("--agents", type=int, default=6)
    p.add_argument("--operators", type=int, default=2)
    p.add_argument("--work-s", type=float, default=1.0, help="seconds each command works")
    p.add_argument("--fault-every", type=float, default=3.0, help="mean seconds between faults")
    p.add_argument("--timeout", type=float, default=1200.0, help="give up (a violation) after this long")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--workdir", default=".cache/chaos")
    p.add_argument("--keep", action="store_true", help="leave the control plane running afterwards")
    args = p.parse_args(argv)
    chaos = Chaos(args)
    stop_on_sigterm()
    try:
        chaos.setup()
        try:
            chaos.run()
            chaos.check()
            chaos.stop_fleet()
        except (RuntimeError, OSError, errors.TaskleaseError) as exc:  # the harness itself failed: say so
            chaos.figures.violations.append(f"the run stopped early: {type(exc).__name__}: {str(exc)[:300]}")
    finally:
        chaos.teardown()
    return chaos.report()


def _leads(readyz: str) -> bool:
    """`/readyz` names the role whether or not the operator is ready yet: "ready leader",
    "starting leader" (its backlog not yet reconciled), "not ready (leader): why"."""
    return "leader" in readyz.split(":", 1)[0]


if __name__ == "__main__":
    raise SystemExit(main())

"""Bad input, hand edits and crashes, tried as a careless user or admin would (issue 9),
against a real API server. Agents run as the chart's agent ServiceAccount, bound to a Pod."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import (ROOT, Cluster, Operator, Process, agent_pod_kubeconfig, audit_lines, audit_since, make_task,
                      service_account_kubeconfig, tasklease_cmd, wait_for)
from tasklease.agent import Agent, Identity
from tasklease.agent.cancel import _QueueFollower
from tasklease.agent.runner import Runner
from tasklease.agent.sdk import instance_gone
from tasklease.api import errors, models
from tasklease_dev.cluster import free_port
from tasklease.kube import LEASES, TASKQUEUES, TASKS, Kube
from tasklease.operator.controller import _serve_http
from tasklease.operator.health import Health, WatchHealth
from tasklease.operator.leader import ElectionConfig, LeaderElector
from tasklease.operator.reconciler import Reconciler
from tasklease.protocol import Protocol, TaskView, record

FAST = {"leaseDurationSeconds": 5, "backoff": {"initialSeconds": 0, "maxSeconds": 0}}


def _agent_config(cluster: Cluster, namespace: str, pod: str, chart_roles: dict[str, str], tmp_path: Path) -> Path:
    return agent_pod_kubeconfig(cluster, namespace, pod, chart_roles["agent"], tmp_path)


def _status(kube: Kube, name: str) -> dict[str, object]:
    return kube.get(TASKS, name).get("status") or {}


# -- 1. a deeply nested payload ------------------------------------------------------------


def test_a_deeply_nested_payload_neither_stops_the_operator_nor_runs(
        cluster: Cluster, kube: Kube, namespace: str, operator_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    depth = 9_990  # about the deepest object the API server stores
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(30_000)  # for this test's own json: the library leaves the limit alone
    try:
        make_task(kube, "deep", queue="q", payload=json.loads('{"a":' * depth + "1" + "}" * depth))
    finally:
        sys.setrecursionlimit(limit)
    op = operator_factory("--no-leader-elect")  # started with that Task present
    status = wait_for(lambda: _status(kube, "deep").get("phase") == "Failed" and _status(kube, "deep"),
                      timeout=60, message="the deep task failed")
    assert status["reason"] == "InvalidPayload"
    assert f"the limit is {models.MAX_PAYLOAD_DEPTH}" in str(status["lastError"])
    make_task(kube, "normal", queue="q")  # and the operator goes on working
    wait_for(lambda: _status(kube, "normal").get("phase") == "Pending", timeout=60, message="normal projected")
    assert op.proc.poll() is None
    assert "RecursionError" not in op.output() and "Traceback" not in op.output()


# -- 2. a deleted Task stops its holder -------------------------------------------------------


def test_deleting_a_held_task_stops_its_command_and_exits_4(
        cluster: Cluster, kube: Kube, namespace: str, chart_roles: dict[str, str], tmp_path: Path) -> None:
    make_task(kube, "doomed", queue="d", **FAST)
    config = _agent_config(cluster, namespace, "runner-0", chart_roles, tmp_path)
    pidfile = tmp_path / "pid"
    runner = Process(tasklease_cmd("run", f"--kubeconfig={config}", "--queue", "d", "--grace", "2", "--",
                                   "sh", "-c", f'echo $$ > {pidfile}; exec sleep 600'),
                     log=tmp_path / "run.log", env={"POD_NAME": "runner-0"})
    pid = int(wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), message="the command to start"))
    kube.delete(TASKS, "doomed")
    assert runner.wait(60) == errors.LostLease.exit_code, runner.output()
    assert "completed" not in runner.output()
    wait_for(lambda: not os.path.exists(f"/proc/{pid}") or _zombie(pid), timeout=30, message="the command stopped")
    # The garbage collector sees Tasks once its discovery, every 30 s, has found their CRD: in a
    # control plane just started, that can be most of a minute.
    wait_for(lambda: kube.get_or_none(LEASES, "doomed") is None, timeout=90,
             message="the Lease gone (garbage collector)")
    time.sleep(2)  # renewals every ~1.7 s: a holder that recreated the Lease would have by now
    assert kube.get_or_none(LEASES, "doomed") is None  # only a claim creates a Lease


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_renewal_of_a_deleted_lease_is_lost_not_a_create(kube: Kube) -> None:
    make_task(kube, "gone", queue="g")
    agent = Agent(kube, identity=Identity(pod="p", instance="1"))
    task = agent.claim("g", timeout=30)
    kube.delete(LEASES, "gone")
    with pytest.raises(errors.LostLease):
        agent.protocol.renew(task.held)
    assert kube.get_or_none(LEASES, "gone") is None
    task.detach()
    agent.close()


# -- 3. a lowered epoch ---------------------------------------------------------------------------


def test_a_lowered_epoch_is_never_handed_out_twice(kube: Kube) -> None:
    make_task(kube, "lowered", queue="l", maxAttempts=5, **FAST)
    first = Agent(kube, identity=Identity(pod="first", instance="1"))
    held = first.claim("l", timeout=30)
    assert held.epoch == 1
    kube.merge_patch(LEASES, "lowered", {"spec": {"leaseTransitions": 0}})
    protocol = Protocol(kube)
    protocol.requeue(TaskView.of(kube.get(TASKS, "lowered")), protocol.read(kube.namespace, "lowered"))
    second = Agent(kube, identity=Identity(pod="second", instance="1"))
    again = second.claim("l", timeout=30)
    assert again.epoch == 2  # never 1 again
    with pytest.raises(errors.LostLease):
        first.protocol.complete(held.held, "stale")
    again.complete("fresh")
    assert record.decode(kube.get(LEASES, "lowered")).result == "fresh"
    held.detach()
    first.close()
    second.close()


# -- 4. stripped labels ---------------------------------------------------------------------------


def test_a_lease_with_its_labels_stripped_is_found_by_its_owner_and_expired(
        cluster: Cluster, kube: Kube, namespace: str, operator: Operator, tmp_path: Path) -> None:
    make_task(kube, "stripped", queue="s", **FAST)
    config = cluster.namespaced_kubeconfig(namespace, tmp_path)
    holder = Process([sys.executable, str(ROOT / "tests" / "agents" / "hold.py"), str(config), "s",
                      str(tmp_path / "never")], log=tmp_path / "hold.log", env={"POD_NAME": "stripped-agent"})
    wait_for(lambda: holder.output().startswith("{"), timeout=30, message="the holder to claim")
    wait_for(lambda: _status(kube, "stripped").get("phase") == "Running", message="status Running")
    kube.request("PATCH", LEASES.path(namespace, "stripped"), content_type="application/json-patch+json",
                 body=[{"op": "remove", "path": "/metadata/labels"}, {"op": "remove", "path": "/metadata/annotations"}])
    holder.kill(signal.SIGKILL)
    holder.wait(10)
    other = Agent(kube, identity=Identity(pod="other", instance="1"))
    task = other.claim("s", timeout=90)  # the operator repaired and expired it
    assert task.epoch == 2
    task.complete("recovered")
    wait_for(lambda: _status(kube, "stripped").get("phase") == "Succeeded", message="status Succeeded")
    assert "labels were removed" in operator.output()
    other.close()


def test_writes_keep_labels_and_annotations_they_do_not_own(kube: Kube) -> None:
    make_task(kube, "labelled", queue="k")
    agent = Agent(kube, identity=Identity(pod="p", instance="1"))
    task = agent.claim("k", timeout=30)
    kube.merge_patch(LEASES, "labelled", {"metadata": {"labels": {"team": "blue"}, "annotations": {"note": "mine"}}})
    agent.protocol.renew(task.held)  # a 409 first (the hand edit moved it), then a retry
    task.complete("done")
    meta = kube.get(LEASES, "labelled")["metadata"]
    assert meta["labels"]["team"] == "blue" and meta["annotations"]["note"] == "mine"
    assert meta["annotations"][record.ANN_OUTCOME] == "Succeeded"
    assert record.LABEL_HOLDER_POD not in meta["labels"]  # ours, removed when freed
    agent.close()


# -- 5. large payloads and one bad task in --loop ------------------------------------------------


def test_a_large_payload_reaches_the_command_and_the_loop_goes_on(
        cluster: Cluster, kube: Kube, namespace: str, chart_roles: dict[str, str], tmp_path: Path) -> None:
    big = {"blob": "x" * (1024 * 1024)}
    make_task(kube, "big", queue="b", payload=big)
    make_task(kube, "small", queue="b", payload={"n": 1})
    config = _agent_config(cluster, namespace, "looper-0", chart_roles, tmp_path)
    script = 'wc -c < "$TASKLEASE_PAYLOAD_FILE"; if [ -n "${TASKLEASE_PAYLOAD+set}" ]; then echo env; fi'
    ran = subprocess.run(tasklease_cmd("run", f"--kubeconfig={config}", "--queue", "b", "--loop", "--wait", "5",
                                       "--", "sh", "-c", script),
                         capture_output=True, text=True, timeout=120, env={**os.environ, "POD_NAME": "looper-0"})
    assert ran.returncode == 0, ran.stderr
    big_result = record.decode(kube.get(LEASES, "big")).result
    assert big_result == str(len(json.dumps(big, separators=(",", ":"))))  # in the file, not in the environment
    assert record.decode(kube.get(LEASES, "small")).result.splitlines() == ['7', "env"]


# -- 6. exit codes -----------------------------------------------------------------------------


def test_exit_codes_for_missing_tasks_namespaces_and_rights(
        cluster: Cluster, kube: Kube, namespace: str, tmp_path: Path) -> None:
    config = cluster.namespaced_kubeconfig(namespace, tmp_path)

    def cli(*args: str, kubeconfig: Path = config) -> subprocess.CompletedProcess[str]:
        return subprocess.run(tasklease_cmd(args[0], f"--kubeconfig={kubeconfig}", *args[1:]),
                              capture_output=True, text=True,
                              timeout=60, env={**os.environ, "POD_NAME": "codes"})

    for verb in ("renew", "complete"):
        done = cli(verb, "no-such-task", "--holder", "codes/1", "--epoch", "1")
        assert done.returncode == errors.NotFound.exit_code, done.stderr
        assert "does not exist" in done.stderr and "Traceback" not in done.stderr
    claimed = cli("claim", "--queue", "q", "-n", "no-such-namespace")
    assert claimed.returncode == errors.NotFound.exit_code, claimed.stderr
    assert "namespace 'no-such-namespace' does not exist" in claimed.stderr
    nobody = service_account_kubeconfig(cluster, namespace, "nobody", "no-such-role", tmp_path)
    make_task(kube, "unreachable-for-nobody", queue="q")
    ran = cli("run", "--queue", "q", "--", "true", kubeconfig=nobody)
    assert ran.returncode == errors.Forbidden.exit_code, ran.stderr
    assert "Traceback" not in ran.stderr


def test_an_operator_without_rights_is_not_ready_and_says_why(
        cluster: Cluster, namespace: str, tmp_path: Path) -> None:
    nobody = service_account_kubeconfig(cluster, namespace, "op-nobody", "no-such-role", tmp_path)
    op = Operator(nobody, namespace, tmp_path / "operator.log", "--no-leader-elect")
    try:
        code, body = wait_for(lambda: (r := op.get("/readyz"))[0] and r, timeout=60, message="an answer")
        assert code == 503 and "Forbidden" in body, body
        assert "not ready: Forbidden" in op.output()
    finally:
        assert op.stop() == 0
    assert "Traceback" not in op.output()


def test_a_bad_operator_configuration_is_refused_at_start(cluster: Cluster, tmp_path: Path) -> None:
    for flags, word in ((["--grace=-20"], "--grace"), (["--workers=0"], "--workers")):
        ran = subprocess.run(tasklease_cmd("operator", f"--kubeconfig={cluster.kubeconfig}", *flags),
                             capture_output=True, text=True, timeout=60)
        assert ran.returncode == errors.Invalid.exit_code, ran.stderr
        assert word in ran.stderr and "Traceback" not in ran.stderr


# -- 7. a recreated CRD ---------------------------------------------------------------------------


def test_the_operator_recovers_from_a_recreated_crd(
        cluster: Cluster, kube: Kube, namespace: str, operator: Operator) -> None:
    crd = ROOT / "crds" / "tasks.tasklease.dev.yaml"
    cluster.kubectl("delete", "-f", str(crd), "--wait=true")
    cluster.kubectl("apply", "-f", str(crd))
    cluster.kubectl("wait", "--for=condition=Established", "-f", str(crd), "--timeout=60s")
    wait_for(lambda: _create_or_none(kube, "after-crd"), timeout=60, message="the new CRD serving")
    wait_for(lambda: _status(kube, "after-crd").get("phase") == "Pending", timeout=90,
             message=f"status written after the CRD came back; log:\n{operator.output()[-2000:]}")
    # Ready again once kopf's new watches run and its failed requests are 30 s behind it.
    wait_for(lambda: operator.get("/readyz")[0] == 200, timeout=90, message="ready again")


def test_the_watches_are_restarted_for_a_recreated_crd_only_once_the_new_one_is_served(kube: Kube) -> None:
    """kopf looks up what it watches when it starts: a restart on the new CRD's first event,
    before it is Established, left the operator without a watch of Tasks for good."""
    health = Health(kube, Reconciler(kube, grace_s=1.0), namespaces=[kube.namespace], threads=[],
                    elector_alive=None, watches=WatchHealth())
    restarts: list[str] = []
    health.restart_watches = lambda: restarts.append(health.problem)
    served = {"conditions": [{"type": "NamesAccepted", "status": "True"}, {"type": "Established", "status": "True"}]}

    def crd(uid: str, status: dict[str, Any] | None) -> dict[str, Any]:
        return {"metadata": {"name": "tasks.tasklease.dev", "uid": uid}, **({"status": status} if status else {})}

    health.on_crd("ADDED", crd("old", served))
    health.on_crd("DELETED", crd("old", served))
    assert "was deleted" in health.problem
    health.on_crd("ADDED", crd("new", None))  # just created: nothing is served yet
    health.on_crd("MODIFIED", crd("new", {"conditions": [{"type": "NamesAccepted", "status": "True"}]}))
    assert restarts == [] and "was deleted" in health.problem
    health.on_crd("MODIFIED", crd("new", served))
    assert restarts == [""]  # once, and ready again
    health.on_crd("MODIFIED", crd("new", served))
    assert restarts == [""]


def _create_or_none(kube: Kube, name: str) -> bool:
    try:
        make_task(kube, name)
        return True
    except (errors.CRDMissing, errors.NotFound):
        return False


# -- 8. an agent started during an outage -------------------------------------------------------


def _unreachable(cluster: Cluster, tmp_path: Path) -> Path:
    """A kubeconfig whose API server is away (a free port): an outage."""
    config = cluster.kubeconfig.read_text().replace(
        cluster.kubeconfig.read_text().split("server: ")[1].split()[0], f"https://127.0.0.1:{free_port()}")
    dead = tmp_path / "dead.kubeconfig"
    dead.write_text(config)
    return dead


def test_run_loop_started_during_an_outage_keeps_retrying(cluster: Cluster, tmp_path: Path) -> None:
    dead = _unreachable(cluster, tmp_path)
    once = subprocess.run(tasklease_cmd("run", f"--kubeconfig={dead}", "--queue", "q", "--", "true"),
                          capture_output=True, text=True, timeout=60)
    assert once.returncode == errors.Unreachable.exit_code, once.stderr
    looping = Process(tasklease_cmd("run", f"--kubeconfig={dead}", "--queue", "q", "--loop", "--", "true"),
                      log=tmp_path / "loop.log")
    wait_for(lambda: looping.output().count("retrying") >= 3, timeout=60, message="three retries")
    assert looping.proc.poll() is None
    assert looping.stop() == errors.RUN_STOPPED
    assert "Traceback" not in looping.output()


# -- 9. a zombie is not a live sibling -------------------------------------------------------------


def test_a_zombie_process_counts_as_gone() -> None:
    child = subprocess.Popen(["sleep", "0.2"])
    ticks = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    instance = f"{child.pid}.{ticks}.abcd"
    assert not instance_gone(instance)  # running
    wait_for(lambda: _zombie(child.pid), timeout=10, message="the child to exit")  # not reaped: a zombie
    assert instance_gone(instance) and instance_gone(f"worker:{instance}")  # a container-named instance too
    child.wait()


# -- 10. SIGTERM to the operator ------------------------------------------------------------------


def test_sigterm_stops_the_operator_cleanly(operator_factory, namespace: str,  # type: ignore[no-untyped-def]
                                            audit_log: Path) -> None:
    start = audit_lines(audit_log)
    op = operator_factory()  # with leader election
    # Ready is ours (the Task and Lease watches, the election); kopf may still be discovering
    # the API for its Pod and CRD watches. A SIGTERM then costs kopf's 5-s wait for a discovery
    # request it left behind (docs/operator.md): this test stops an operator fully started.
    wait_for(lambda: _watched_pods(audit_log, start, f"system:serviceaccount:{namespace}:tasklease-operator"),
             message="kopf's Pod watch")
    began = time.monotonic()
    assert op.stop() == 0
    # Unless `release_stop_waiter` frees it, kopf waits 5 s for its task waiting on our stop flag.
    assert time.monotonic() - began < 4
    assert "Traceback" not in op.output()
    assert "operator" in op.output().splitlines()[-1] and "stopped" in op.output().splitlines()[-1]


def _watched_pods(audit_log: Path, start: int, user: str) -> bool:
    """Has `user` started a watch of Pods, by the audit log's events from the `start`-th on?"""
    return any(e["verb"] == "watch" and (e.get("objectRef") or {}).get("resource") == "pods"
               and e["user"].get("username") == user for e in audit_since(audit_log, start))


# -- found by reading ---------------------------------------------------------------------------


@pytest.mark.parametrize("lost", ["before the check", "while spawning"])
def test_a_loss_before_the_command_runs_never_leaves_it_running(kube: Kube, monkeypatch: pytest.MonkeyPatch,
                                                                  lost: str) -> None:
    """`tasklease run` checks ownership, registers the kill on loss, then spawns: a loss before
    the check starts nothing, and one inside the spawn (the kill found no child yet) still
    stops the command."""
    make_task(kube, "racy", queue="race", **FAST)
    agent = Agent(kube, identity=Identity(pod="spawner", instance="1"))
    task = agent.claim("race", timeout=30, interrupt=False)
    runner = Runner(agent, queue="race", argv=["sleep", "600"], grace_s=2)

    def lose() -> None:
        """A real loss: the Task is deleted, and the agent hears of it through its watch. Returns
        once every kill-on-loss callback (the runner's registered first) has run."""
        stopped = threading.Event()
        task.on_lost.append(lambda _task: stopped.set())
        kube.delete(TASKS, "racy")
        assert stopped.wait(30), "the agent never noticed the deleted Task"

    spawned: list[subprocess.Popen[bytes]] = []
    real_popen = subprocess.Popen

    def spawn(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        if lost == "while spawning":
            lose()  # ownership was checked and the kill registered; the command is not started yet
        spawned.append(real_popen(*args, **kwargs))
        return spawned[-1]

    monkeypatch.setattr(subprocess, "Popen", spawn)
    if lost == "before the check":
        lose()
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            runner._run_one(task)
        except BaseException as exc:  # noqa: BLE001 - the assertion below says what it was
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        thread.join(60)
        assert not thread.is_alive(), "the command kept running after the loss"
    finally:
        for child in spawned:
            if child.poll() is None:
                child.kill()
        thread.join(10)
        agent.close()
    assert len(outcome) == 1 and isinstance(outcome[0], errors.LostLease), outcome
    if lost == "before the check":
        assert spawned == []  # never started
    else:
        assert [child.returncode for child in spawned] == [-signal.SIGTERM]  # started, then stopped


def test_liveness_fails_when_the_reconciler_or_the_election_thread_dies(kube: Kube) -> None:
    reconciler = Reconciler(kube, grace_s=1.0, namespaces=[kube.namespace])
    stop = threading.Event()
    workers = threading.Thread(target=reconciler.run, args=(stop,), name="reconciler", daemon=True)
    broken = threading.Event()

    def clock() -> float:
        if broken.is_set():
            raise RuntimeError("a bug in the election loop")
        return time.monotonic()

    config = ElectionConfig(namespace=kube.namespace, lease_duration_s=3, renew_deadline_s=2, retry_period_s=0.2)
    elector = LeaderElector(kube, config, identity="live", on_started=lambda: None, on_stopped=lambda: None,
                            monotonic=clock)
    health = Health(kube, reconciler, namespaces=[kube.namespace], threads=[workers], elector_alive=elector.alive,
                    watches=WatchHealth())
    workers.start()
    elector.start()
    server = _serve_http("127.0.0.1", 0, threading.Event(), elector, health)

    def healthz() -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/healthz", timeout=5) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    try:
        assert elector.leading.wait(30)
        assert health.dead() == "" and healthz() == (200, "ok\n")
        broken.set()  # the election thread dies of an unexpected error
        wait_for(lambda: not elector.alive(), message="the election thread to die")
        assert health.dead() == "thread(s) died: leader-election"
        stop.set()  # the reconciler's workers end, and with them its thread
        workers.join(30)
        assert health.dead() == "thread(s) died: reconciler, leader-election"
        assert healthz() == (503, "thread(s) died: reconciler, leader-election\n")
    finally:
        stop.set()
        elector.stop()
        server.shutdown()


def test_a_task_leaving_the_cancel_watch_during_an_outage_is_a_warning_not_a_traceback(
        cluster: Cluster, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Found by the short chaos run: the API server was killed just as a task left the holder's
    watch, and the check of why (a GET) raised into the watch thread, which logged a traceback."""
    away = Kube.connect(kubeconfig=str(_unreachable(cluster, tmp_path)))
    follower = _QueueFollower(away, ("ns", "q"))
    told: list[str] = []
    follower.watchers["t"] = ("uid-1", 0, told.append)
    with caplog.at_level(logging.WARNING, logger="tasklease.agent.cancel"):
        follower.seen("DELETED", {"metadata": {"name": "t", "namespace": "ns", "uid": "uid-1"}})
    assert told == []  # not known to be deleted: the next renewal decides
    assert "its holder, if any, learns it at its next renewal" in caplog.text


# -- documented but untested behaviours --------------------------------------------------------


def test_cli_submit_file_list_all_describe_claim_wait_release_requeue_and_fail_final(
        cluster: Cluster, kube: Kube, namespace: str, tmp_path: Path) -> None:
    config = cluster.namespaced_kubeconfig(namespace, tmp_path)

    def cli(*args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(tasklease_cmd(args[0], f"--kubeconfig={config}", *args[1:]), capture_output=True,
                              text=True, timeout=60, input=input, env={**os.environ, "POD_NAME": "cli-pod"})

    manifest = "\n---\n".join(
        f"apiVersion: tasklease.dev/v1alpha1\nkind: Task\nmetadata: {{name: {n}}}\n"
        f"spec: {{queue: cq, maxAttempts: 5, backoff: {{initialSeconds: 0, maxSeconds: 0}}}}" for n in ("one", "two"))
    assert cli("submit", "-f", "-", input=manifest).returncode == 0
    everywhere = cli("list", "-A")
    assert everywhere.returncode == 0 and namespace in everywhere.stdout and "one" in everywhere.stdout

    claimed = json.loads(cli("claim", "--queue", "cq", "--wait", "30").stdout)
    who = ["--holder", claimed["holder"], "--epoch", str(claimed["epoch"])]
    assert cli("release", claimed["name"], *who).returncode == 0
    rec = record.decode(kube.get(LEASES, claimed["name"]))
    assert (rec.state, rec.history[-1].outcome) == (record.FREE, "Released")

    again = json.loads(cli("claim", "--queue", "cq").stdout)
    assert cli("requeue", again["name"]).returncode == 0  # a successful requeue frees it at once
    assert record.decode(kube.get(LEASES, again["name"])).state == record.FREE

    last = json.loads(cli("claim", "--queue", "cq").stdout)
    done = cli("fail", last["name"], "--holder", last["holder"], "--epoch", str(last["epoch"]), "-m", "no", "--final")
    assert done.returncode == 0, done.stderr
    final = record.decode(kube.get(LEASES, last["name"]))
    assert (final.outcome, final.reason, final.error) == ("Failed", "Failed", "no")  # not retried
    described = cli("describe", last["name"])
    assert described.returncode == 0 and "Failed" in described.stdout and last["holder"] in described.stdout


def test_run_on_sigterm_releases_and_exits_143_and_grace_escalates_to_sigkill(
        cluster: Cluster, kube: Kube, namespace: str, tmp_path: Path) -> None:
    make_task(kube, "stubborn", queue="st", leaseDurationSeconds=30)
    config = cluster.namespaced_kubeconfig(namespace, tmp_path)
    pidfile = tmp_path / "pid"
    # A command that ignores SIGTERM: only the SIGKILL after --grace ends it.
    runner = Process(tasklease_cmd("run", f"--kubeconfig={config}", "--queue", "st", "--grace", "1", "--",
                                   "sh", "-c", f"trap '' TERM; echo $$ > {pidfile}; while true; do sleep 0.1; done"),
                     log=tmp_path / "run.log", env={"POD_NAME": "stopper"})
    pid = int(wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), message="the command to start"))
    runner.kill(signal.SIGTERM)
    assert runner.wait(60) == errors.RUN_STOPPED, runner.output()
    assert not os.path.exists(f"/proc/{pid}") or _zombie(pid)  # SIGKILLed after the grace period
    assert f"stopped: released {namespace}/stubborn (attempt 1)" in runner.output()
    rec = record.decode(kube.get(LEASES, "stubborn"))
    assert (rec.state, rec.history[-1].outcome) == (record.FREE, "Released")


def test_operator_deadline_lowered_max_attempts_orphans_and_metrics(
        cluster: Cluster, kube: Kube, namespace: str, operator: Operator) -> None:
    from datetime import UTC, datetime, timedelta

    soon = (datetime.now(UTC) + timedelta(seconds=3)).strftime("%Y-%m-%dT%H:%M:%SZ")
    make_task(kube, "late", queue="never-worked", deadline=soon)
    status = wait_for(lambda: _status(kube, "late").get("phase") == "Failed" and _status(kube, "late"),
                      timeout=60, message="DeadlineExceeded")
    assert status["reason"] == "DeadlineExceeded"

    make_task(kube, "lowered-max", queue="lm", maxAttempts=3, **FAST)
    agent = Agent(kube, identity=Identity(pod="lm", instance="1"))
    for _ in range(2):
        agent.claim("lm", timeout=30).release()
    kube.merge_patch(TASKS, "lowered-max", {"spec": {"maxAttempts": 1}})  # below the 2 attempts made
    status = wait_for(lambda: _status(kube, "lowered-max").get("phase") == "Failed" and _status(kube, "lowered-max"),
                      timeout=60, message="dead-lettered after maxAttempts was lowered")
    assert status["reason"] == "DeadLettered"

    # A Lease left by an older Task of the same name: removed, and the new Task runs from epoch 1.
    old = make_task(kube, "reborn", queue="rb")
    agent.claim("rb", timeout=30).detach()
    kube.delete(TASKS, "reborn")
    make_task(kube, "reborn", queue="rb")
    wait_for(lambda: (kube.get_or_none(LEASES, "reborn") or {}).get("metadata", {}).get("ownerReferences", [{}])[0]
             .get("uid") != old["metadata"]["uid"], timeout=60, message="the old Lease removed")
    # A new agent, which knows nothing of the old task. The wait above ends as soon as the old Lease is
    # gone, and the agent that held the old task may still have it in its view then: a claim from that
    # view makes a Lease for the deleted task, and that agent is told at once that the task was deleted.
    newcomer = Agent(kube, identity=Identity(pod="rb", instance="1"))
    fresh = newcomer.claim("rb", timeout=30)
    assert fresh.epoch == 1
    fresh.complete("new life")
    wait_for(lambda: _status(kube, "reborn").get("phase") == "Succeeded", message="the new task done")
    newcomer.close()
    agent.close()

    assert operator.metric("tasklease_claims_total") >= 1  # quick claim-and-release pairs may merge
    # Counted after the status writes that the waits above saw.
    wait_for(lambda: operator.metric("tasklease_dead_letters_total") >= 1, message="the dead letter counted")
    wait_for(lambda: operator.metric("tasklease_completions_total") >= 3, message="the third completion counted")
    assert operator.metric("tasklease_operator_leader") == 1


def test_the_queue_controls_come_back_with_a_recreated_taskqueue_crd(
        cluster: Cluster, kube: Kube, namespace: str, operator: Operator) -> None:
    """The TaskQueue watches are optional (ready without them), but not left stopped for good
    once their CRD is served again: a new queue's status is written."""
    crd = ROOT / "crds" / "taskqueues.tasklease.dev.yaml"
    cluster.kubectl("delete", "-f", str(crd), "--wait=true")
    wait_for(lambda: "watch of taskqueues stopped" in operator.output(), timeout=60,
             message="the TaskQueue watch to stop")
    cluster.kubectl("apply", "-f", str(crd))
    cluster.kubectl("wait", "--for=condition=Established", "-f", str(crd), "--timeout=60s")
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(
        {"apiVersion": "tasklease.dev/v1alpha1", "kind": "TaskQueue", "metadata": {"name": "back"},
         "spec": {"paused": True}}))
    wait_for(lambda: (kube.get(TASKQUEUES, "back").get("status") or {}).get("observedGeneration"), timeout=90,
             message=f"the new queue's status; log:\n{operator.output()[-2000:]}")
    assert "the TaskQueue CRD (taskqueues.tasklease.dev) is not installed" in operator.output()

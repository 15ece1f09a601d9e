"""The `tasklease` CLI end to end, with shell-script agents, against a real API server."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from conftest import (Cluster, Operator, Process, agent_pod_kubeconfig, make_task, service_account_kubeconfig,
                      tasklease_cmd, wait_for)
from tasklease.protocol import record
from tasklease.kube import LEASES, TASKS, Kube


AGENT_VERBS = ("claim", "renew", "complete", "fail", "release", "run")
CLI_POD = "cli-agent"


@pytest.fixture
def cli(cluster: Cluster, namespace: str, chart_roles: dict[str, str], tmp_path: Path):  # type: ignore[no-untyped-def]
    """The CLI: agent verbs as the chart's agent ServiceAccount (a token bound to a Pod, so
    RBAC and the admission policy apply), the others as a namespaced admin."""
    config = cluster.namespaced_kubeconfig(namespace, tmp_path)
    agent_config = agent_pod_kubeconfig(cluster, namespace, CLI_POD, chart_roles["agent"], tmp_path)

    def run(*args: str, input: str | None = None, env: dict[str, str] | None = None,
            kubeconfig: Path | None = None) -> subprocess.CompletedProcess[str]:
        chosen = kubeconfig or (agent_config if args and args[0] in AGENT_VERBS else config)
        return subprocess.run(tasklease_cmd(*args), capture_output=True, text=True, input=input, timeout=120,
                              env={**os.environ, "KUBECONFIG": str(chosen), "POD_NAME": CLI_POD, **(env or {})})
    run.kubeconfig = config  # type: ignore[attr-defined]
    run.agent_kubeconfig = agent_config  # type: ignore[attr-defined]
    return run


def _clean_error(result: subprocess.CompletedProcess[str]) -> str:
    """One line on stderr, no traceback."""
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_submit_list_get_and_a_shell_agent_completing_it(cli, kube: Kube) -> None:  # type: ignore[no-untyped-def]
    assert cli("submit", "--queue", "sh", "--name", "hello", "--payload", '{"who": "world"}').returncode == 0
    listed = cli("list", "--queue", "sh").stdout
    assert "hello" in listed and "sh" in listed
    script = 'read -r payload; echo "got $payload for $TASKLEASE_TASK at epoch $TASKLEASE_EPOCH"'
    ran = cli("run", "--queue", "sh", "--", "sh", "-c", script)
    assert ran.returncode == 0, ran.stderr
    rec = record.decode(kube.get(LEASES, "hello"))
    assert rec.outcome == "Succeeded"
    assert rec.result == 'got {"who":"world"} for hello at epoch 1'
    assert json.loads(cli("get", "hello", "-o", "json").stdout)["spec"]["payload"] == {"who": "world"}


def test_claim_renew_complete_from_a_shell_script(cli, cluster: Cluster, namespace: str,  # type: ignore[no-untyped-def]
                                                  kube: Kube) -> None:
    make_task(kube, "scripted", queue="manual")
    # The kubeconfig's namespace is another one: renew and complete find the task in the
    # namespace claim exported (TASKLEASE_NAMESPACE), as -n said.
    script = f"""
set -e
eval "$({' '.join(tasklease_cmd())} claim -n {namespace} --queue manual --format env)"
{' '.join(tasklease_cmd())} renew
{' '.join(tasklease_cmd())} complete --result "done by $TASKLEASE_HOLDER"
echo "$TASKLEASE_EPOCH"
"""
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120,
                         env={"KUBECONFIG": str(cluster.kubeconfig), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"
    assert record.decode(kube.get(LEASES, "scripted")).result.startswith("done by ")


def test_a_command_outliving_its_lease_duration_keeps_it_by_renewing(cli, kube: Kube) -> None:  # type: ignore[no-untyped-def]
    make_task(kube, "long", queue="slow", leaseDurationSeconds=5)
    started = time.monotonic()
    ran = cli("run", "--queue", "slow", "--", "sh", "-c", "sleep 9; echo finished")
    assert ran.returncode == 0, ran.stderr
    assert time.monotonic() - started > 9
    rec = record.decode(kube.get(LEASES, "long"))
    assert (rec.outcome, rec.epoch, rec.result) == ("Succeeded", 1, "finished")  # one attempt, never expired


def test_the_command_is_terminated_the_moment_ownership_is_lost(
        cli, kube: Kube, operator: Operator, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    make_task(kube, "doomed", queue="cancel-me", leaseDurationSeconds=5)
    marker = tmp_path / "terminated"
    script = f"trap 'echo term > {marker}; exit 143' TERM; echo started; while true; do sleep 0.1; done"
    agent = Process(tasklease_cmd("run", "--queue", "cancel-me", "--grace", "5", "--", "sh", "-c", script),
                    log=tmp_path / "run.log", env={"KUBECONFIG": str(cli.kubeconfig)})
    wait_for(lambda: "started" in agent.output(), timeout=30, message="the command to start")
    assert cli("cancel", "doomed").returncode == 0
    code = agent.wait(30)
    assert code == 4, agent.output()  # lost ownership
    assert marker.read_text().strip() == "term"  # SIGTERM reached the command
    assert "lost" in agent.output().splitlines()[-1]
    wait_for(lambda: (kube.get(TASKS, "doomed").get("status") or {}).get("phase") == "Cancelled",
             message="the task to be Cancelled")
    again = cli("cancel", "doomed")
    assert again.returncode == 0 and "already Cancelled: nothing to cancel" in again.stdout


def test_a_failing_command_is_retried_then_dead_lettered(cli, kube: Kube) -> None:  # type: ignore[no-untyped-def]
    make_task(kube, "broken", queue="bad", maxAttempts=2, backoff={"initialSeconds": 0, "maxSeconds": 0})
    assert cli("run", "--queue", "bad", "--", "sh", "-c", "exit 7").returncode == 11
    # No operator runs here: the Task keeps its default status (Pending), and the retry is
    # judged by its Lease alone. `-v`: a failure shows why the claim passed it over.
    retried = cli("-v", "run", "--queue", "bad", "--", "sh", "-c", "exit 7")
    assert retried.returncode == 11, f"{retried.stderr}\nits Lease: {record.decode(kube.get(LEASES, 'broken'))}"
    nothing = cli("run", "--queue", "bad", "--", "true")
    assert nothing.returncode == 3
    rec = record.decode(kube.get(LEASES, "broken"))
    assert (rec.outcome, rec.reason, rec.epoch) == ("Failed", "DeadLettered", 2)
    assert "exited with code 7" in rec.error


@pytest.mark.parametrize(("args", "code", "says"), [
    (("claim", "--queue", "empty"), 3, "nothing claimable in queue 'empty'"),
    (("get", "missing"), 5, "not found"),
    (("complete", "missing", "--holder", "me/1", "--epoch", "1"), 5, "does not exist"),
    (("submit", "--queue", "Not_A_Label"), 9, "spec.queue"),
    (("requeue", "missing"), 5, "not found"),
])
def test_errors_are_one_clear_line_with_a_documented_exit_code(cli, args, code, says) -> None:  # type: ignore[no-untyped-def]
    result = cli(*args)
    assert result.returncode == code, result.stderr
    assert says in _clean_error(result)


def test_completing_a_task_never_claimed_says_it_has_no_lease(cli) -> None:  # type: ignore[no-untyped-def]
    assert cli("submit", "--queue", "never", "--name", "unclaimed").returncode == 0
    result = cli("complete", "unclaimed", "--holder", "me/1", "--epoch", "1")
    assert result.returncode == 4, result.stderr
    assert "has no lease: never claimed, or its lease was deleted" in _clean_error(result)


def test_bad_flags_exit_2(cli) -> None:  # type: ignore[no-untyped-def]
    result = cli("claim", "--no-such-flag")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr


def test_no_cluster_reachable_exits_7(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import yaml

    config = yaml.safe_load(cli.kubeconfig.read_text())
    config["clusters"][0]["cluster"]["server"] = "https://127.0.0.1:1"
    dead = tmp_path / "dead.kubeconfig"
    dead.write_text(yaml.safe_dump(config))
    result = cli("list", kubeconfig=dead)
    assert result.returncode == 7
    assert "cannot reach the Kubernetes API server" in _clean_error(result)
    result = cli("list", kubeconfig=tmp_path / "absent.kubeconfig")
    assert result.returncode == 7
    assert "no usable cluster configuration" in _clean_error(result)


def test_a_tls_port_asked_in_plain_http_is_no_kubernetes_api_server(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The API server answers plain HTTP with a 400 that carries no Status: the URL is wrong, not the task."""
    config = yaml.safe_load(cli.kubeconfig.read_text())
    cluster = config["clusters"][0]["cluster"]
    cluster["server"] = cluster["server"].replace("https://", "http://")
    plain = tmp_path / "plain.kubeconfig"
    plain.write_text(yaml.safe_dump(config))
    for args in (("list",), ("get", "t"), ("submit", "--queue", "q"), ("pause", "q"), ("top", "--once")):
        result = cli(*args, kubeconfig=plain)
        assert result.returncode == 7, result.stderr
        line = _clean_error(result)
        assert f"{cluster['server']} does not answer as the Kubernetes API server does (HTTP 400: Client sent an HTTP" \
            " request to an HTTPS server.)" in line, line


def test_rbac_denial_exits_6(cli, cluster: Cluster, namespace: str, chart_roles: dict[str, str],
                             tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    agent_config = service_account_kubeconfig(cluster, namespace, "agent", chart_roles["agent"], tmp_path)
    result = cli("submit", "--queue", "q", kubeconfig=agent_config)  # agents may not create tasks
    assert result.returncode == 6
    assert "forbidden" in _clean_error(result)


def test_crd_not_installed_is_named(cluster: Cluster, namespace: str) -> None:
    from tasklease.api import errors
    from tasklease.kube import Resource

    missing = Resource("tasklease.dev", "v1alpha1", "notinstalled")
    with pytest.raises(errors.CRDMissing, match="is not installed"):
        cluster.kube(namespace).list(missing)


def test_a_repeated_ending_succeeds_but_another_outcome_is_refused(cli, kube: Kube) -> None:  # type: ignore[no-untyped-def]
    make_task(kube, "twice", queue="again")
    claimed = json.loads(cli("claim", "--queue", "again").stdout)
    who = ["twice", "--holder", claimed["holder"], "--epoch", str(claimed["epoch"])]
    assert cli("complete", *who, "--result", "r1").returncode == 0
    assert cli("complete", *who, "--result", "r1").returncode == 0  # a retry after a lost answer
    refused = cli("complete", *who, "--result", "r2")
    assert refused.returncode == 4
    assert "is over" in _clean_error(refused)
    assert record.decode(kube.get(LEASES, "twice")).result == "r1"


def test_global_flags_go_before_or_after_the_command(cli, cluster: Cluster, namespace: str) -> None:  # type: ignore[no-untyped-def]
    assert cli("-n", namespace, "submit", "--queue", "g", "--name", "before").returncode == 0
    assert cli("submit", "-n", namespace, "--queue", "g", "--name", "after").returncode == 0
    other = f"{namespace}-other"
    cluster.kubectl("create", "namespace", other)
    try:
        assert cli("--namespace", other, "submit", "--queue", "g", "--name", "elsewhere").returncode == 0
        names = cli("-n", namespace, "list", "-o", "name").stdout.split()
        assert sorted(names) == ["task.tasklease.dev/after", "task.tasklease.dev/before"]
        everywhere = cli("list", "-A", "--queue", "g").stdout
        # Other tests' namespaces may hold tasks of queue g too: look only at this task's row.
        assert [line for line in everywhere.splitlines() if "elsewhere" in line.split()][0].split()[0] == other
    finally:
        cluster.kubectl("delete", "namespace", other, "--wait=false")
    version = cli("--version")
    assert version.returncode == 0 and version.stdout.startswith("tasklease ")


def test_list_filters_and_formats_and_shows_the_default_phase_of_a_task_never_written(  # type: ignore[no-untyped-def]
        cli, kube: Kube) -> None:
    make_task(kube, "a1", queue="fa")
    make_task(kube, "a2", queue="fa")
    make_task(kube, "b1", queue="fb")
    kube.merge_patch(TASKS, "a2", {"metadata": {"labels": {"team": "shop"}}})
    table = cli("list").stdout.splitlines()
    assert table[0].split() == ["NAME", "QUEUE", "PHASE", "HOLDER", "ATTEMPT", "AGE"]
    # No operator runs: the CRD's default status, exactly as `kubectl get tasks` shows it.
    assert all(line.split()[2] == "Pending" for line in table[1:])
    assert sorted(x.split()[0] for x in cli("list", "--queue", "fa").stdout.splitlines()[1:]) == ["a1", "a2"]
    assert cli("list", "-l", "team=shop", "-o", "jsonpath={.items[*].metadata.name}").stdout.strip() == "a2"
    assert sorted(cli("list", "--phase", "Pending", "-o", "name").stdout.split()) == [
        "task.tasklease.dev/a1", "task.tasklease.dev/a2", "task.tasklease.dev/b1"]
    assert cli("list", "--phase", "Failed").stdout == ""
    listed = json.loads(cli("list", "--queue", "fb", "-o", "json").stdout)
    assert [i["metadata"]["name"] for i in listed["items"]] == ["b1"]
    assert "managedFields" not in listed["items"][0]["metadata"]
    got = cli("get", "b1", "-o", "yaml").stdout
    assert "managedFields" not in got and "queue: fb" in got
    assert cli("get", "b1", "-o", "jsonpath={.spec.queue}").stdout.strip() == "fb"
    assert "REASON" in cli("list", "-o", "wide").stdout.splitlines()[0]
    assert cli("list", "-o", "xml").returncode == 2


def test_list_watch_prints_each_change(cli, kube: Kube, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    make_task(kube, "w1", queue="wq")
    watcher = Process(tasklease_cmd("list", "--watch", "--queue", "wq", "-o", "name"), log=tmp_path / "watch.log",
                      env={"KUBECONFIG": str(cli.kubeconfig)})
    try:
        wait_for(lambda: "task.tasklease.dev/w1" in watcher.output(), message="the initial list")
        make_task(kube, "w2", queue="wq")
        make_task(kube, "other", queue="elsewhere")
        wait_for(lambda: "task.tasklease.dev/w2" in watcher.output(), message="the new task")
        assert "other" not in watcher.output()
    finally:
        watcher.stop()


def test_a_closed_pipe_ends_quietly(cli, kube: Kube, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    make_task(kube, "p0", queue="pipe")
    out = tmp_path / "head.out"
    pipeline = Process(["bash", "-c", f"set -o pipefail; {' '.join(tasklease_cmd())} list --watch | head -n 1 > {out}"],
                       log=tmp_path / "pipe.log", env={"KUBECONFIG": str(cli.kubeconfig)})
    wait_for(lambda: out.exists() and out.read_text().startswith("NAME"), message="head's one line")
    make_task(kube, "p1", queue="pipe")  # the next line meets the closed pipe
    assert pipeline.wait(60) == 0, pipeline.output()
    assert pipeline.output() == ""


def test_submit_of_a_file_whose_tasks_partly_exist_reports_each_and_goes_on(  # type: ignore[no-untyped-def]
        cli, kube: Kube, tmp_path: Path) -> None:
    make_task(kube, "same", queue="f")
    make_task(kube, "differs", queue="f", priority=5)
    docs = [{"apiVersion": "tasklease.dev/v1alpha1", "kind": "Task", "metadata": {"name": n}, "spec": {"queue": "f"}}
            for n in ("same", "differs", "new")]
    path = tmp_path / "tasks.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    result = cli("submit", "-f", str(path))
    assert result.stdout.splitlines() == ["task/same unchanged (already submitted)", "task/new created"]
    assert "task/differs already exists with another spec" in _clean_error(result)
    assert result.returncode == 10
    assert kube.get(TASKS, "differs")["spec"]["priority"] == 5
    again = cli("submit", "-f", str(path))
    assert "task/new unchanged (already submitted)" in again.stdout


def test_help_says_what_each_command_does_with_an_example_and_the_codes_once(cli) -> None:  # type: ignore[no-untyped-def]
    top = cli("--help").stdout
    assert "exit codes:" in top and "retry" in top and "global flags" in top
    for command in ("submit", "list", "get", "retry", "run", "claim", "cancel"):
        text = cli(command, "--help").stdout
        assert "example:\n  " in text and "tasklease " + command in text.split("example:")[1], command
        assert "exit codes: see `tasklease --help`" in text and "  9  refused" not in text, command
    # What `claim --format env` exported is where the held verbs look first.
    assert "default: $TASKLEASE_NAMESPACE" in " ".join(cli("renew", "--help").stdout.split())


def test_a_result_over_the_limit_is_refused_and_the_task_stays_held(cli, kube: Kube) -> None:  # type: ignore[no-untyped-def]
    make_task(kube, "big", queue="big")
    claimed = json.loads(cli("claim", "--queue", "big").stdout)
    who = ["big", "--holder", claimed["holder"], "--epoch", str(claimed["epoch"])]
    refused = cli("complete", *who, "--result", "x" * 9000)
    assert refused.returncode == 9
    assert "the limit is 8192" in _clean_error(refused)
    assert record.decode(kube.get(LEASES, "big")).state == record.HELD  # nothing lost: complete with a reference
    assert cli("complete", *who, "--result", '{"url": "s3://results/big.json"}').returncode == 0


def test_a_command_that_cannot_start_loses_no_task(cli, kube: Kube, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A script whose interpreter is missing is found only when it is started: its task is
    given back (not failed), and `run --loop` stops rather than take the next one."""
    for name in ("typo-1", "typo-2"):
        assert cli("submit", "--queue", "typo", "--name", name).returncode == 0
    script = tmp_path / "send-email.sh"
    script.write_text("#!/no/such/interpreter\n")
    script.chmod(0o755)
    ran = cli("run", "--queue", "typo", "--loop", "--wait", "2", "--", str(script))
    # `run` logs what it does; its error is the last line.
    assert ran.returncode == 2 and "Traceback" not in ran.stderr, ran.stderr
    assert "cannot start" in ran.stderr.strip().splitlines()[-1] and "released" in ran.stderr
    assert "running" in ran.stderr and ran.stderr.count("claimed ") == 1  # one task taken, then it stopped
    leases = [record.decode(lease) for name in ("typo-1", "typo-2") if (lease := kube.get_or_none(LEASES, name))]
    assert len(leases) == 1 and leases[0].state == record.FREE
    assert leases[0].history[-1].outcome == "Released"


def test_a_claim_it_cannot_print_is_given_back(cli, kube: Kube) -> None:  # type: ignore[no-untyped-def]
    """Nobody would learn what was claimed: the task is released and the exit code says so."""
    assert cli("submit", "--queue", "unread", "--name", "unread-1").returncode == 0
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the claim prints
    try:
        done = subprocess.run(tasklease_cmd("claim", "--queue", "unread"), stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=120, env={**os.environ, "KUBECONFIG": str(cli.agent_kubeconfig),
                                                           "POD_NAME": CLI_POD})
    finally:
        os.close(write)
    assert done.returncode == 1 and "could not print" in _clean_error(done)
    rec = record.decode(kube.get(LEASES, "unread-1"))
    assert rec.state == record.FREE and rec.history[-1].outcome == "Released"


def test_resume_in_a_namespace_that_does_not_exist(cluster: Cluster) -> None:
    """As pause does (its create would get 404): exit 5, not "it is not paused"."""
    done = subprocess.run(tasklease_cmd("resume", "q", "-n", "no-such-namespace", f"--kubeconfig={cluster.kubeconfig}"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 5 and "does not exist" in _clean_error(done)

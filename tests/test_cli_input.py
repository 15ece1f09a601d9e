"""Bad input to `tasklease`, refused before any request: one line on stderr and a documented
exit code, never a traceback (no control plane: the kubeconfig names a port nobody serves)."""

from __future__ import annotations

import argparse
import contextlib
import http.server
import importlib
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tasklease.api import errors, models
from tasklease.operator import options

pytestmark = pytest.mark.unit

cli_main = importlib.import_module("tasklease.cli.main")  # the module: the package exports its `main`


def _unreachable(folder: Path) -> Path:
    """A kubeconfig naming a port nobody serves."""
    return _kubeconfig(folder, "https://127.0.0.1:1")


def _kubeconfig(folder: Path, server: str, cluster: dict[str, str] | None = None,
                user: dict[str, str] | None = None) -> Path:
    """`cluster`: its TLS settings (default: none checked); `user`: its credentials (default: a token)."""
    config = folder / "kubeconfig"
    config.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": server, **(cluster or {"insecure-skip-tls-verify": True})}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        "users": [{"name": "u", "user": user or {"token": "t"}}]}))
    return config


@pytest.fixture
def tasklease(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Any:
    """`tasklease ARGS` in this process: (exit code, the one line on stderr)."""
    monkeypatch.setenv("KUBECONFIG", str(_unreachable(tmp_path)))

    def run(*args: str) -> tuple[int, str]:
        code = cli_main.main(list(args))
        err = capsys.readouterr().err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        return code, err.strip()
    return run


def test_a_kubeconfig_that_is_no_mapping(tasklease: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for text in ("hello\n", "- a\n- b\n", "current-context: x\ncontexts: [x]\n"):
        (tmp_path / "bad").write_text(text)
        monkeypatch.setenv("KUBECONFIG", str(tmp_path / "bad"))
        code, err = tasklease("list")
        assert code == errors.Unreachable.exit_code and "not a kubeconfig" in err


@pytest.mark.parametrize("args", [("get", ""), ("describe", ".."), ("cancel", "t-1/status"), ("requeue", "a%2Fb")])
def test_a_name_that_no_object_can_have(tasklease: Any, args: tuple[str, ...]) -> None:
    code, err = tasklease(*args)
    assert code == errors.Invalid.exit_code and "not a Kubernetes object name" in err


def test_submitted_documents_that_are_no_task(tasklease: Any, tmp_path: Path) -> None:
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    code, err = tasklease("submit", "-f", str(tmp_path / "list.yaml"))
    assert code == errors.Invalid.exit_code and "document 1 of" in err and "is not a Task object" in err
    (tmp_path / "meta.yaml").write_text("kind: Task\nmetadata: hello\nspec: {queue: q}\n")
    code, err = tasklease("submit", "-f", str(tmp_path / "meta.yaml"))
    assert code == errors.Invalid.exit_code and "is not a Task object" in err


def test_a_payload_deeper_than_every_reader_reads(tasklease: Any, tmp_path: Path) -> None:
    """Refused before it exists, rather than found unclaimable later; one too deep for json too."""
    for depth in (models.MAX_PAYLOAD_DEPTH + 1, 5000):
        deep = "[" * depth + "]" * depth
        code, err = tasklease("submit", "--queue", "q", "--payload", deep)
        assert code == errors.Invalid.exit_code and "nests" in err
        (tmp_path / "deep.json").write_text(deep)
        code, err = tasklease("submit", "--queue", "q", "--payload-file", str(tmp_path / "deep.json"))
        assert code == errors.Invalid.exit_code and "nests" in err
    code, err = tasklease("submit", "--queue", "q", "--payload-file", str(tmp_path / "missing.json"))
    assert code == errors.Invalid.exit_code and "cannot read" in err


def test_stdin_that_is_closed(tasklease: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stdin", None)
    code, err = tasklease("submit", "-f", "-")
    assert code == errors.Invalid.exit_code and "stdin" in err and "closed" in err


def test_top_without_a_terminal_points_to_once(tasklease: Any) -> None:
    code, err = tasklease("top")
    assert code == errors.BadArguments.exit_code and "--once" in err


@pytest.mark.parametrize("args", [("claim", "--queue", "q", "--wait", "nan"), ("run", "--queue", "q", "--wait", "-1"),
                                  ("run", "--queue", "q", "--grace", "inf", "--", "true"),
                                  ("run", "--queue", "q", "--metrics-port", "99999", "--", "true"),
                                  ("run", "--queue", "q", "--loop", "--concurrency", "0", "--", "true"),
                                  ("run", "--queue", "q", "--loop", "--concurrency", "99999999999999999999", "--",
                                   "true")])
def test_flags_out_of_range_are_bad_flags(args: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli_main.main(list(args))
    assert exited.value.code == 2 and "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("args", [("list", "--bogus"), ("claim",), ("completion", "fish"), ("list", "-n", "../x"),
                                  ("get", "-n", "UPPER", "t"), ("-n", "", "list"), ("list", "-o", "bogus"),
                                  ("list", "--queue", "x=y"), ("retry", "--queue", "a,b"), ("pause", "UPPER"),
                                  ("list", "-n", "ns\n"), ("resume", "x" * 64)])
def test_a_bad_flag_is_one_line_that_points_to_help(args: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli_main.main(list(args))
    err = capsys.readouterr().err
    assert exited.value.code == errors.BadArguments.exit_code
    assert len(err.strip().splitlines()) == 1 and "--help)" in err, err


@pytest.mark.parametrize(("args", "why"), [
    (("submit",), "submit needs --queue"), (("retry",), "retry needs task names"),
    (("retry", "t", "--queue", "q"), "not both"), (("run", "--queue", "q"), "run needs a command"),
    (("renew", "t"), "need the task name, --holder and --epoch"),
    (("run", "--queue", "q", "--timeout", "0", "--", "true"), "--timeout must be more than 0 seconds"),
    (("submit", "--queue", "q", "--name", ""), "--name is empty"),
])
def test_flags_missing_or_at_odds_are_bad_flags_before_any_request(tasklease: Any, args: tuple[str, ...],
                                                                  why: str) -> None:
    code, err = tasklease(*args)
    assert code == errors.BadArguments.exit_code and why in err, err


def test_an_argument_that_is_not_utf8_is_a_bad_flag(tasklease: Any) -> None:
    for args in (("get", "a\udcffb"), ("submit", "--queue", "q", "--payload", '{"a": "\udcff"}')):
        code, err = tasklease(*args)
        assert code == errors.BadArguments.exit_code and "not UTF-8 text: " in err and "\\xff" in err


@pytest.mark.parametrize(("document", "why"), [
    ("payload: {when: 2020-01-01}", "is not JSON: Object of type date"),
    ("payload: {x: !!binary aGk=}", "is not JSON: Object of type bytes"),
    ("payload: {x: .nan}", "is not JSON: Out of range float"),
    ("payload: &a [*a]", "is not JSON: Circular reference"),
])
def test_a_document_json_cannot_say_is_refused_by_name(tasklease: Any, tmp_path: Path, document: str,
                                                       why: str) -> None:
    (tmp_path / "t.yaml").write_text(f"kind: Task\nmetadata: {{name: t}}\nspec: {{queue: q, {document}}}\n")
    code, err = tasklease("submit", "-f", str(tmp_path / "t.yaml"))
    assert code == errors.Invalid.exit_code and "document 1 of" in err and why in err, err


def test_files_without_a_task_submit_nothing_and_say_so(tasklease: Any, tmp_path: Path) -> None:
    (tmp_path / "empty.yaml").write_text("")
    (tmp_path / "dashes.yaml").write_text("---\n---\n")
    code, err = tasklease("submit", "-f", str(tmp_path / "empty.yaml"), "-f", str(tmp_path / "dashes.yaml"))
    assert code == errors.Invalid.exit_code and "no Task in" in err and "nothing submitted" in err


def test_a_document_in_a_namespace_no_namespace_can_have(tasklease: Any, tmp_path: Path) -> None:
    (tmp_path / "t.yaml").write_text("kind: Task\nmetadata: {name: t, namespace: [x]}\nspec: {queue: q}\n")
    code, err = tasklease("submit", "-f", str(tmp_path / "t.yaml"))
    assert code == errors.Invalid.exit_code and "is not a namespace name" in err


@pytest.mark.parametrize("payload", ['{"a": NaN}', '{"a": Infinity}', "[-Infinity]"])
def test_a_payload_json_cannot_say(tasklease: Any, payload: str) -> None:
    code, err = tasklease("submit", "--queue", "q", "--payload", payload)
    assert code == errors.Invalid.exit_code and "payload is not valid JSON" in err and "is not JSON" in err


@pytest.mark.parametrize("payload", ["null", "[1, 2]", "7", '"text"'])
def test_a_payload_that_is_no_object(tasklease: Any, payload: str) -> None:
    code, err = tasklease("submit", "--queue", "q", "--payload", payload)
    assert code == errors.Invalid.exit_code and "the payload must be a JSON object, not" in err, err


def test_a_command_run_cannot_start_claims_nothing(tasklease: Any, tmp_path: Path) -> None:
    """Looked for before the first claim (the kubeconfig's server is never asked)."""
    code, err = tasklease("run", "--queue", "q", "--loop", "--", str(tmp_path / "send-emial.sh"))
    assert code == errors.BadArguments.exit_code and "cannot start" in err and "nothing claimed" in err


def test_an_error_nobody_foresaw_is_still_one_line(tasklease: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(args: argparse.Namespace) -> int:
        raise AttributeError("'str' object has no attribute 'get'")
    monkeypatch.setattr(cli_main, "cmd_list", broken)
    code, err = tasklease("list")
    assert code == 1 and err.startswith("tasklease: unexpected error: AttributeError") and "-v" in err


def test_claim_waits_for_an_unreachable_server_no_longer_than_asked(tasklease: Any) -> None:
    """The queue's watches would retry for 30 s; `--wait 2` gives up on them after 2 s."""
    began = time.monotonic()
    code, err = tasklease("claim", "--queue", "q", "--wait", "2")
    assert code == errors.Unreachable.exit_code and "cannot reach" in err
    assert time.monotonic() - began < 15


def test_top_once_fails_at_once_against_an_unreachable_server(tasklease: Any) -> None:
    """As `list` does: its watches would retry for 30 s before a snapshot for a script failed."""
    began = time.monotonic()
    code, err = tasklease("top", "--once")
    assert code == errors.Unreachable.exit_code and "cannot reach" in err
    assert time.monotonic() - began < 10


@contextlib.contextmanager
def _web_server(status: int) -> Iterator[str]:
    """A server that answers every GET with `status` and an HTML page: its URL."""
    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(b"<html>a web page</html>\n")

        def log_message(self, *args: Any) -> None:
            pass  # stderr is the command's

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("status", [200, 404])
def test_a_web_server_is_no_kubernetes_api_server(tasklease: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  status: int) -> None:
    """Its page is no object, and its 404 no missing task: every command says the server is the wrong one."""
    with _web_server(status) as url:
        monkeypatch.setenv("KUBECONFIG", str(_kubeconfig(tmp_path, url)))
        for args in (("list",), ("get", "t"), ("top", "--once")):
            code, err = tasklease(*args)
            assert code == errors.Unreachable.exit_code, err
            assert "does not answer as the Kubernetes API server does" in err and f"HTTP {status}" in err, err


@pytest.mark.parametrize(("status", "code"), [(401, errors.Forbidden.exit_code), (403, errors.Forbidden.exit_code),
                                              (413, errors.Invalid.exit_code)])
def test_a_proxy_refusal_in_its_own_words_keeps_its_meaning(tasklease: Any, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch, status: int,
                                                            code: int) -> None:
    """An authenticating proxy before the API server says no, or too large, without a Status:
    still forbidden or refused, at once, not a wrong server retried."""
    with _web_server(status) as url:
        monkeypatch.setenv("KUBECONFIG", str(_kubeconfig(tmp_path, url)))
        got, err = tasklease("list")
        assert got == code, err


@pytest.mark.parametrize("missing", ["certificate-authority", "client-certificate", "client-key", "tokenFile"])
def test_a_file_the_kubeconfig_names_that_is_not_there_is_named(tasklease: Any, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch, missing: str) -> None:
    """ssl says "No such file or directory" and no more: the line names the file and its setting."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=test"], check=True, capture_output=True)
    cluster = {"certificate-authority": str(cert)}
    user = {} if missing == "tokenFile" else {"client-certificate": str(cert), "client-key": str(key)}
    (cluster if missing == "certificate-authority" else user)[missing] = "gone.pem"  # beside the kubeconfig
    monkeypatch.setenv("KUBECONFIG", str(_kubeconfig(tmp_path, "https://127.0.0.1:1", cluster, user)))
    code, err = tasklease("list")
    where = "cluster 'c'" if missing == "certificate-authority" else "user 'u'"
    assert code == errors.Unreachable.exit_code
    assert f"cannot read {tmp_path / 'gone.pem'}, the {missing} of {where}: No such file or directory" in err, err


@pytest.mark.parametrize(("cluster", "user", "says"), [
    ({"certificate-authority": "{key}"}, {}, "the certificate-authority of cluster 'c' holds no usable certificate"),
    ({}, {"client-certificate": "{cert}"}, "user 'u' has no client-key"),
    ({}, {"client-key": "{key}"}, "user 'u' has no client-certificate"),
    ({}, {"client-certificate": "{key}", "client-key": "{key}"},
     "the client-certificate and client-key of user 'u' are no certificate and matching key"),
])
def test_credentials_the_kubeconfig_cannot_use_are_named(tasklease: Any, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch, cluster: dict[str, str],
                                                         user: dict[str, str], says: str) -> None:
    """A file of the wrong kind, or half a client certificate: ssl's error names neither."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=test"], check=True, capture_output=True)
    files = {"{key}": str(key), "{cert}": str(cert)}
    monkeypatch.setenv("KUBECONFIG", str(_kubeconfig(tmp_path, "https://127.0.0.1:1",
                                                     {k: files[v] for k, v in cluster.items()},
                                                     {k: files[v] for k, v in user.items()})))
    code, err = tasklease("list")
    assert code == errors.Unreachable.exit_code
    assert says in err and len(err.strip().splitlines()) == 1, err


def test_what_a_one_shot_command_retried_is_not_told_without_v(tmp_path: Path) -> None:
    """Its own process: the log configuration is the command's, not pytest's."""
    done = subprocess.run([sys.executable, "-m", "tasklease.cli", f"--kubeconfig={_unreachable(tmp_path)}", "claim",
                           "--queue", "q", "--wait", "2"], capture_output=True, text=True, timeout=60)
    assert done.returncode == errors.Unreachable.exit_code
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and "cannot reach" in done.stderr, done.stderr


@pytest.mark.parametrize(("flags", "why"), [
    (("--coalesce", "nan"), "--coalesce must be a number of seconds"), (("--coalesce", "-1"), "--coalesce must be"),
    (("--grace", "inf"), "--grace must be >= 0"), (("--workers", "99999999999"), "--workers must be 1 to"),
    (("--leader-election-lease-duration", "nan"), "--leader-election-lease-duration must be"),
    (("-n", "../x"), "is not a namespace name"),
])
def test_operator_settings_that_cannot_work_are_refused_at_start(flags: tuple[str, ...], why: str) -> None:
    parser = argparse.ArgumentParser()
    options.add_operator_arguments(parser)
    with pytest.raises(errors.Invalid, match=re.escape(why)):
        options.validate(parser.parse_args(list(flags)))

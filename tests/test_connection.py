"""Reading a kubeconfig or a pod's service account without the `kubernetes` package (pure, no API server)."""

from __future__ import annotations

import base64
import contextlib
import os
import socket
import ssl
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml

from tasklease.api import errors
from tasklease.kube import connection

pytestmark = pytest.mark.unit


def _kubeconfig(tmp_path: Path, user: dict[str, Any], cluster: dict[str, Any] | None = None,
                namespace: str = "work") -> str:
    doc = {"apiVersion": "v1", "kind": "Config", "current-context": "here",
           "contexts": [{"name": "here", "context": {"cluster": "c", "user": "u", "namespace": namespace}},
                        {"name": "other", "context": {"cluster": "c", "user": "u"}}],
           "clusters": [{"name": "c", "cluster": cluster or {"server": "https://127.0.0.1:6443/",
                                                             "insecure-skip-tls-verify": True}}],
           "users": [{"name": "u", "user": user}]}
    path = tmp_path / "config"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_a_token_and_the_contexts_namespace_are_read(tmp_path: Path) -> None:
    found = connection.connect(kubeconfig=_kubeconfig(tmp_path, {"token": "abc"}))
    assert (found.host, found.namespace, found.authorization()) == ("https://127.0.0.1:6443", "work", "Bearer abc")
    other = connection.connect(kubeconfig=_kubeconfig(tmp_path, {"token": "abc"}), context="other")
    assert other.namespace == "default"  # the context asked for, not the current one


def test_a_token_file_is_read_again_as_it_rotates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "token").write_text("one\n")
    found = connection.connect(kubeconfig=_kubeconfig(tmp_path, {"tokenFile": "token"}))  # beside the kubeconfig
    assert found.authorization() == "Bearer one"
    (tmp_path / "token").write_text("two\n")
    assert found.authorization() == "Bearer one"  # not on every request
    later = connection.time.monotonic() + 61
    monkeypatch.setattr(connection.time, "monotonic", lambda: later)
    assert found.authorization() == "Bearer two"


def test_a_client_certificate_given_inline_is_loaded(tmp_path: Path) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=test"], check=True, capture_output=True)
    data = {"client-certificate-data": base64.b64encode(cert.read_bytes()).decode(),
            "client-key-data": base64.b64encode(key.read_bytes()).decode()}
    cluster = {"server": "https://127.0.0.1:6443", "certificate-authority-data": data["client-certificate-data"]}
    found = connection.connect(kubeconfig=_kubeconfig(tmp_path, data, cluster))
    assert found.authorization() is None  # the certificate is the credential
    broken = {**data, "client-key-data": base64.b64encode(b"not a key").decode()}
    with pytest.raises(errors.Unreachable, match="no usable cluster configuration"):
        connection.connect(kubeconfig=_kubeconfig(tmp_path, broken, cluster))


def test_the_kubernetes_package_gets_the_same_kubeconfig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBECONFIG", _kubeconfig(tmp_path, {"token": "abc"}))
    found = connection.connect()
    assert found.kubernetes_configuration().host == "https://127.0.0.1:6443"  # for kopf: not in-cluster


def test_a_missing_context_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(errors.Unreachable, match="no context named 'nowhere'"):
        connection.connect(kubeconfig=_kubeconfig(tmp_path, {"token": "abc"}), context="nowhere")


def test_what_only_the_kubernetes_package_reads_goes_to_it(tmp_path: Path) -> None:
    found = connection.connect(kubeconfig=_kubeconfig(tmp_path, {"username": "ann", "password": "secret"}))
    assert found.authorization() == "Basic " + base64.b64encode(b"ann:secret").decode()
    assert found.namespace == "work" and found.kubernetes_configuration().host == "https://127.0.0.1:6443"


def test_a_merged_kubeconfig_is_read_as_kubectl_reads_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The context (and current-context) in one file, its cluster and user in another: kubectl's
    # rules for $KUBECONFIG, the first file that sets a name wins.
    first, second = tmp_path / "first", tmp_path / "second"
    first.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "Config", "current-context": "here", "contexts": [
        {"name": "here", "context": {"cluster": "c", "user": "u", "namespace": "work"}}]}))
    second.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "Config", "current-context": "elsewhere",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:6443", "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "abc"}}]}))
    monkeypatch.setenv("KUBECONFIG", f"{first}{os.pathsep}{tmp_path / 'absent'}{os.pathsep}{second}")
    found = connection.connect()
    assert (found.host, found.namespace, found.authorization()) == ("https://127.0.0.1:6443", "work", "Bearer abc")
    merged = str(second) + os.pathsep + str(first)  # the other order: the second file's current-context, unknown
    with pytest.raises(errors.Unreachable, match="elsewhere"):
        connection.connect(kubeconfig=merged)


def test_the_agents_import_does_not_load_the_kubernetes_package() -> None:
    """It costs every agent process a large part of its start-up time and memory."""
    code = "import sys, tasklease.agent.sdk, tasklease.cli.main; print('kubernetes' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_connections_started_together_send_well_formed_handshakes(tmp_path: Path) -> None:
    """urllib3 sets ALPN on the shared context for each new connection; a handshake that another
    thread starts meanwhile must not read a list being replaced (the server would answer
    "decode error")."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    server.set_alpn_protocols(["http/1.1"])
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    cluster = {"server": f"https://127.0.0.1:{listener.getsockname()[1]}", "certificate-authority": str(cert)}
    pool = connection.connect(kubeconfig=_kubeconfig(tmp_path, {"token": "t"}, cluster)).pool
    tls = pool.connection_pool_kw["ssl_context"]
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            accepted, _ = listener.accept()
            with accepted, contextlib.suppress(OSError):
                server.wrap_socket(accepted, server_side=True).close()

    def as_urllib3_does() -> None:
        while not done.is_set():
            tls.set_alpn_protocols(["http/1.1"])

    failures: list[str] = []

    def connect() -> None:
        for _ in range(20):
            with socket.create_connection(listener.getsockname()) as raw:
                try:
                    tls.wrap_socket(raw, server_hostname="127.0.0.1").close()
                except ssl.SSLError as exc:
                    failures.append(str(exc))

    threads = [threading.Thread(target=serve, daemon=True), threading.Thread(target=as_urllib3_does)]
    clients = [threading.Thread(target=connect) for _ in range(4)]
    for thread in threads + clients:
        thread.start()
    for thread in clients:
        thread.join()
    done.set()
    socket.create_connection(listener.getsockname()).close()  # wakes the server to see `done`
    listener.close()
    assert failures == []
    with pytest.raises(ValueError, match="http/1.1"):
        tls.set_alpn_protocols(["h2"])  # the one list stays, rather than a silent change

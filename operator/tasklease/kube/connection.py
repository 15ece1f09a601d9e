"""Where the API server is and how to prove who we are: a kubeconfig or a pod's service account.

The common cases are read here: a pod's service account (its token re-read as the kubelet
rotates it), and a kubeconfig whose user has a client certificate or a token. Anything else
a kubeconfig can say (an exec plugin, an auth provider, a proxy, several files in
$KUBECONFIG) is read by the `kubernetes` package, imported only then: importing it costs
every process a large part of its start-up time and memory, and an agent pod has many. Which
context is current is decided here, by kubectl's rule (the first file that names one).
"""

from __future__ import annotations

import base64
import os
import ssl
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import urllib3
import yaml

from tasklease.api import errors

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
_TOKEN_REREAD_S = 60.0  # a rotated service account token is valid for a while after rotation
# What only the `kubernetes` package reads: a user or cluster that says any of these.
_ELSEWHERE = ("exec", "auth-provider", "username", "proxy-url", "tls-server-name")


@dataclass
class Connection:
    """One API server: its address, a connection pool that trusts it (and shows our client
    certificate, if any), and the Authorization header of each request (None: none)."""

    host: str
    pool: urllib3.PoolManager
    authorization: Callable[[], str | None]
    namespace: str  # the default namespace of the kubeconfig's context, or the pod's
    kubeconfig: str | None = None  # where it came from (None: $KUBECONFIG or ~/.kube/config)
    context: str | None = None
    in_cluster: bool = False
    _configuration: Any = field(default=None, repr=False)

    def kubernetes_configuration(self) -> Any:
        """The same credentials as a `kubernetes.client.Configuration`, for code that needs
        the `kubernetes` package (kopf's login, client-go style helpers)."""
        if self._configuration is None:
            self._configuration = _kubernetes_configuration(self.kubeconfig, self.context,
                                                            in_cluster=self.in_cluster)[0]
        return self._configuration


def connect(*, kubeconfig: str | None = None, context: str | None = None, pool_size: int = 16) -> Connection:
    """From `kubeconfig` (else $KUBECONFIG, else ~/.kube/config) or, in a pod without either, in-cluster."""
    try:
        if kubeconfig or os.environ.get("KUBECONFIG") or not os.path.exists(f"{SA_DIR}/namespace"):
            return _from_kubeconfig(kubeconfig, context, pool_size)
        return _in_cluster(pool_size)
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError, ssl.SSLError) as exc:
        raise errors.Unreachable(f"no usable cluster configuration: {exc}") from None


def _in_cluster(pool_size: int) -> Connection:
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        raise ValueError("in a pod, but KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are not set")
    context = _client_tls(cafile=f"{SA_DIR}/ca.crt")
    token = _TokenFile(f"{SA_DIR}/token")
    namespace = Path(f"{SA_DIR}/namespace").read_text().strip()
    return Connection(host=f"https://{_bracketed(host)}:{port}", pool=_pool(context, pool_size),
                      authorization=token.header, namespace=namespace, in_cluster=True)


def _from_kubeconfig(path: str | None, context_name: str | None, pool_size: int) -> Connection:
    # Named explicitly to the `kubernetes` package too: it reads $KUBECONFIG once, when imported.
    source = path or os.environ.get("KUBECONFIG") or "~/.kube/config"
    paths = [p for p in source.split(os.pathsep) if p]
    if len(paths) != 1:  # merged files: the `kubernetes` package's rules
        return _elsewhere(source, context_name, pool_size)
    file = Path(paths[0]).expanduser()
    doc = _load(file)
    name = context_name or doc.get("current-context")
    if not name:
        raise ValueError(f"{file}: no context given and no current-context")
    ctx = _named(doc, "contexts", name, "context")
    cluster = _named(doc, "clusters", ctx["cluster"], "cluster")
    user = _named(doc, "users", ctx["user"], "user") if ctx.get("user") else {}
    if any(key in user or key in cluster for key in _ELSEWHERE):
        return _elsewhere(str(file), context_name, pool_size)
    base = file.parent
    of_cluster, of_user = f"cluster {ctx['cluster']!r}", f"user {ctx.get('user')!r}"
    tls = _client_tls()
    if cluster.get("insecure-skip-tls-verify"):
        tls.check_hostname, tls.verify_mode = False, ssl.CERT_NONE
    elif "certificate-authority-data" in cluster or "certificate-authority" in cluster:
        try:
            if "certificate-authority-data" in cluster:
                tls.load_verify_locations(cadata=base64.b64decode(cluster["certificate-authority-data"]).decode())
            else:
                tls.load_verify_locations(cafile=_readable(base, cluster, "certificate-authority", of_cluster))
        except ssl.SSLError as exc:
            raise ValueError(f"the certificate-authority of {of_cluster} holds no usable certificate "
                             f"({exc.reason or exc})") from None
    if any(f"client-{kind}{data}" in user for kind in ("certificate", "key") for data in ("", "-data")):
        _load_client_certificate(tls, user, base, of_user)
    authorization: Callable[[], str | None] = lambda: None  # noqa: E731 - one of three
    if user.get("token"):
        header = f"Bearer {user['token']}"
        authorization = lambda: header  # noqa: E731
    elif user.get("tokenFile"):
        authorization = _TokenFile(_readable(base, user, "tokenFile", of_user)).header
    return Connection(host=str(cluster["server"]).rstrip("/"), pool=_pool(tls, pool_size),
                      authorization=authorization, namespace=ctx.get("namespace") or "default",
                      kubeconfig=str(file), context=context_name)


def _current_context(paths: list[str]) -> str | None:
    """kubectl's current context of (merged) kubeconfig files: the first file's that names one."""
    return next((str(doc["current-context"]) for doc in _docs(paths) if doc.get("current-context")), None)


def _context(paths: list[str], name: str | None) -> dict[str, Any]:
    """The context `name` of (merged) kubeconfig files: the first file's of that name."""
    entries = (entry for doc in _docs(paths) for entry in doc.get("contexts") or [])
    return next((entry.get("context") or {} for entry in entries if entry.get("name") == name), {})


def _docs(paths: list[str]) -> Iterator[dict[str, Any]]:
    """Each kubeconfig file of `paths` that exists (kubectl skips the others), in order."""
    for path in paths:
        file = Path(path).expanduser()
        if file.is_file():
            yield _load(file)


def _load(file: Path) -> dict[str, Any]:
    """A kubeconfig file's content, which must be a mapping whose sections are lists of mappings."""
    doc = yaml.safe_load(file.read_text()) or {}
    if not isinstance(doc, dict) or not all(
            isinstance(doc.get(section) or [], list) and all(isinstance(e, dict) for e in doc.get(section) or [])
            for section in ("clusters", "contexts", "users")):
        raise ValueError(f"{file}: not a kubeconfig (a YAML mapping with lists of clusters, contexts and users)")
    return doc


def _named(doc: dict[str, Any], section: str, name: str, key: str) -> dict[str, Any]:
    for entry in doc.get(section) or []:
        if entry.get("name") == name:
            found = entry.get(key) or {}
            if not isinstance(found, dict):
                raise ValueError(f"the kubeconfig's {key} named {name!r} is not a mapping")
            return found
    raise ValueError(f"the kubeconfig has no {key} named {name!r}")


def _load_client_certificate(tls: ssl.SSLContext, user: dict[str, Any], base: Path, of_user: str) -> None:
    """`load_cert_chain` reads files only: inline data goes through a private folder, removed at once."""
    with tempfile.TemporaryDirectory(prefix="tasklease-") as folder:
        def path(kind: str) -> str:
            if f"{kind}-data" in user:
                target = Path(folder) / kind
                target.write_bytes(base64.b64decode(user[f"{kind}-data"]))
                return str(target)
            return _readable(base, user, kind, of_user)
        missing = [kind for kind in ("client-certificate", "client-key")
                   if kind not in user and f"{kind}-data" not in user]
        if missing:
            raise ValueError(f"{of_user} has no {missing[0]} (a client certificate needs both it and its key)")
        try:
            tls.load_cert_chain(path("client-certificate"), path("client-key"))
        except ssl.SSLError as exc:
            raise ValueError(f"the client-certificate and client-key of {of_user} are no certificate and "
                             f"matching key ({exc.reason or exc})") from None


def _readable(base: Path, entry: dict[str, Any], key: str, of: str) -> str:
    """The file a kubeconfig setting names (relative to the kubeconfig's folder), which must be
    readable: ssl's error would say neither which file nor which setting."""
    path = base / str(entry[key])
    try:
        path.open("rb").close()
    except OSError as exc:
        raise ValueError(f"cannot read {path}, the {key} of {of}: {exc.strerror or exc}") from None
    return str(path)


_ALPN = ["http/1.1"]  # what urllib3 asks for


class _OneAlpn(ssl.SSLContext):
    """A client context whose ALPN list is set once, when it is made. urllib3 sets the list
    again on the shared context for each new connection, and OpenSSL frees the old list as it
    does: a connection that another thread starts at that moment can copy freed bytes into its
    ClientHello, which the API server refuses ("tlsv1 alert decode error")."""

    def set_alpn_protocols(self, alpn_protocols: Iterable[str]) -> None:
        if list(alpn_protocols) != _ALPN:
            raise ValueError(f"this context speaks {_ALPN} only")


def _client_tls(cafile: str | None = None) -> ssl.SSLContext:
    """`ssl.create_default_context(cafile=...)`, safe to share between threads that connect."""
    tls = _OneAlpn(ssl.PROTOCOL_TLS_CLIENT)  # verifies the certificate and the host name
    if cafile:
        tls.load_verify_locations(cafile=cafile)
    else:
        tls.load_default_certs()
    ssl.SSLContext.set_alpn_protocols(tls, _ALPN)
    return tls


def _pool(tls: ssl.SSLContext, pool_size: int) -> urllib3.PoolManager:
    verify = tls.verify_mode != ssl.CERT_NONE
    return urllib3.PoolManager(maxsize=pool_size, ssl_context=tls, cert_reqs="CERT_REQUIRED" if verify else "CERT_NONE",
                               assert_hostname=None if verify else False)


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class _TokenFile:
    """A bearer token read from a file, read again every `_TOKEN_REREAD_S` (the kubelet rotates it)."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._read_at = -_TOKEN_REREAD_S
        self._value = ""

    def header(self) -> str | None:
        with self._lock:
            if time.monotonic() - self._read_at >= _TOKEN_REREAD_S:
                self._value = Path(self._path).read_text().strip()
                self._read_at = time.monotonic()
            return f"Bearer {self._value}" if self._value else None


def _elsewhere(kubeconfig: str | None, context: str | None, pool_size: int) -> Connection:
    """What the `kubernetes` package reads (exec plugins, auth providers, merged files)."""
    configuration, namespace = _kubernetes_configuration(kubeconfig, context, in_cluster=False)
    configuration.connection_pool_maxsize = pool_size
    configuration.retries = 0
    from kubernetes import client  # noqa: PLC0415 - only for the kubeconfigs that need it

    api = client.ApiClient(configuration)
    return Connection(host=configuration.host, pool=api.rest_client.pool_manager,
                      authorization=lambda: configuration.get_api_key_with_prefix("BearerToken", alias="authorization"),
                      namespace=namespace, kubeconfig=kubeconfig, context=context, _configuration=configuration)


def _kubernetes_configuration(kubeconfig: str | None, context: str | None, *, in_cluster: bool) -> tuple[Any, str]:
    from kubernetes import client, config  # noqa: PLC0415 - see the module's docstring

    configuration = client.Configuration()
    if in_cluster:
        config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        return configuration, Path(f"{SA_DIR}/namespace").read_text().strip()
    paths = [p for p in (kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config").split(os.pathsep) if p]
    name = context or _current_context(paths)  # named to it: it would take the last file's
    try:
        config.load_kube_config(config_file=kubeconfig, context=name,  # type: ignore[no-untyped-call]
                                client_configuration=configuration)
    except config.ConfigException as exc:
        raise ValueError(str(exc)) from None
    return configuration, _context(paths, name).get("namespace") or "default"

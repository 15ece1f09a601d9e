"""A thin, typed door to the Kubernetes API: raw JSON in and out, HTTP statuses as exceptions.

Everything above this module speaks dicts and the exceptions in `tasklease.api.errors`;
this module and `connection` speak HTTP. Writes are never retried here: a 409 is an answer
the protocol must see.
"""

from __future__ import annotations

import http.client
import json
import select
import socket
import threading
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import quote, urlencode

import urllib3

from tasklease.api import errors, resource
from tasklease.kube import chunked, decode
from tasklease.kube.connection import Connection, connect
from tasklease.kube.servertime import ServerClock

JSON = dict[str, Any]
# Unknown fields are an error, not silently dropped (outside `payload`, which keeps them).
_STRICT = {"fieldValidation": "Strict"}
# Bookmarks arrive about once a minute: a stream silent for longer than this is dead.
_WATCH_READ_TIMEOUT_S = 90
_WATCH_READ_BYTES = 65536  # at most, per read of a watch: what has arrived, up to the end of its chunk
INITIAL_EVENTS_END = "k8s.io/initial-events-end"  # the annotation of the bookmark that ends a streaming list
_PAGE = 500  # objects per LIST page
# How the API server words a refusal by a ValidatingAdmissionPolicy or an admission webhook.
_ADMISSION_DENIED = "denied request"
_NOT_SERVED = b"404 page not found"  # the API server's answer to a path it does not serve: no Status


@dataclass(frozen=True)
class Resource:
    """Where a kind lives in the REST API."""

    group: str
    version: str
    plural: str
    namespaced: bool = True

    def path(self, namespace: str | None, name: str | None = None, sub: str | None = None) -> str:
        base = f"/api/{self.version}" if not self.group else f"/apis/{self.group}/{self.version}"
        if namespace is not None and self.namespaced:
            base += f"/namespaces/{quote(namespace)}"
        base += f"/{self.plural}"
        if name is not None:
            base += f"/{_segment(name)}"
        if sub is not None:
            base += f"/{sub}"
        return base


def _segment(name: str) -> str:
    """An object's name as one path segment. No Kubernetes name is empty, "." or "..", or holds
    a "/" or a "%": such a name would address another path (the whole list, a subresource)."""
    if name in ("", ".", "..") or "/" in name or "%" in name:
        raise errors.Invalid(f"not a Kubernetes object name: {name!r}")
    return quote(name, safe="")


TASKS = Resource(resource.GROUP, resource.VERSION, resource.PLURAL)
LEASES = Resource("coordination.k8s.io", "v1", "leases")
TASKQUEUES = Resource(resource.GROUP, resource.VERSION, resource.QUEUE_PLURAL)
PODS = Resource("", "v1", "pods")
EVENTS = Resource("", "v1", "events")
NAMESPACES = Resource("", "v1", "namespaces", namespaced=False)
CRDS = Resource("apiextensions.k8s.io", "v1", "customresourcedefinitions", namespaced=False)


class Hangup:
    """Lets another thread end a watch's response now, though its reader is blocked reading
    (`Kube.watch`): the connection's socket is shut down, and the read ends at once. A hangup
    before the response opens ends it as soon as it does. Only the response it was given is
    ever shut down: once the watch has ended, its connection may serve another request."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.hung_up = False

    def hang_up(self) -> None:
        with self._lock:
            self.hung_up = True
            self._shut(self._sock)

    def _attach(self, resp: urllib3.BaseHTTPResponse) -> None:
        with self._lock:
            self._sock = getattr(getattr(resp, "connection", None), "sock", None)
            if self.hung_up:
                self._shut(self._sock)

    def _detach(self) -> None:
        with self._lock:
            self._sock = None

    @staticmethod
    def _shut(sock: socket.socket | None) -> None:
        if sock is not None:
            # The plain socket's shutdown, under TLS too: `SSLSocket.shutdown` would drop the
            # TLS state that the reading thread is using.
            try:
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
            except OSError:
                pass  # closed already


class Kube:
    """One API client and a default namespace. Thread-safe: urllib3 pools connections."""

    def __init__(self, connection: Connection, namespace: str, *,
                 server_clock: ServerClock | None = None) -> None:
        self.connection = connection
        self.namespace = namespace
        # Every answer's Date header feeds it: decisions against times written on objects use
        # the API server's clock, not this machine's.
        self.server_clock = server_clock or ServerClock()

    def now(self) -> datetime:
        """The API server's time, at the earliest it can be (`ServerClock.earliest`)."""
        return self.server_clock.earliest()

    @classmethod
    def connect(cls, *, kubeconfig: str | None = None, context: str | None = None,
                namespace: str | None = None, pool_size: int = 16) -> Kube:
        """Configure from a kubeconfig (flag, $KUBECONFIG, ~/.kube/config) or, in a pod, in-cluster."""
        found = connect(kubeconfig=kubeconfig, context=context, pool_size=pool_size)
        return cls(found, namespace or found.namespace)

    # -- requests ---------------------------------------------------------------

    def request(self, method: str, path: str, *, query: dict[str, Any] | None = None,
                body: Any = None, content_type: str = "application/json", timeout: float = 30) -> JSON:
        resp = self._send(method, path, query=query or {}, body=body, content_type=content_type,
                          timeout=timeout)
        try:
            raw = resp.data or b"{}"
        finally:
            resp.release_conn()
        try:
            data: JSON = decode.loads(raw)
        except ValueError:
            raise _foreign(self.connection.host, resp.status, raw) from None
        return data

    def _send(self, method: str, path: str, *, query: dict[str, Any], body: Any, content_type: str,
              timeout: float | tuple[float, float]) -> urllib3.BaseHTTPResponse:
        """One HTTP request with the client's authentication; a status >= 400 becomes an exception."""
        url = self.connection.host + path + (f"?{urlencode(query)}" if query else "")
        headers = {"Accept": "application/json", "Content-Type": content_type, "User-Agent": "tasklease"}
        payload = json.dumps(body).encode() if body is not None else None
        sent = self.server_clock.wall()
        try:
            authorization = self.connection.authorization()
            if authorization:
                headers["Authorization"] = authorization
            resp = self.connection.pool.request(
                method, url, body=payload, headers=headers, preload_content=False,
                # A float is a bound on the whole request, connecting included.
                timeout=urllib3.Timeout(connect=10, read=timeout[1]) if isinstance(timeout, tuple)
                else urllib3.Timeout(total=timeout),
                retries=False)
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise errors.Unreachable(f"cannot reach the Kubernetes API server: {_short(exc)}") from None
        self.server_clock.observe(resp.headers.get("Date"), sent=sent, got=self.server_clock.wall())
        if resp.status >= 400:
            data = resp.data
            resp.release_conn()
            raise _error_for(resp.status, data, path=path, host=self.connection.host)
        return resp

    def get(self, res: Resource, name: str, *, namespace: str | None = None, timeout: float = 30) -> JSON:
        return self.request("GET", res.path(namespace or self.namespace, name), timeout=timeout)

    def get_or_none(self, res: Resource, name: str, *, namespace: str | None = None,
                    timeout: float = 30) -> JSON | None:
        try:
            return self.get(res, name, namespace=namespace, timeout=timeout)
        except errors.NotFound:
            return None

    def list(self, res: Resource, *, namespace: str | None = None, all_namespaces: bool = False,
             label_selector: str = "", field_selector: str = "", limit: int = 0, timeout: float = 30,
             not_older_than: str = "") -> JSON:
        """Every selected object, fetched page by page; `metadata.resourceVersion` is the list's.
        With `limit`, only the first page, of at most that many objects. `not_older_than`: as
        in `list_pages`."""
        if limit:
            return next(self.list_pages(res, namespace=namespace, all_namespaces=all_namespaces, limit=limit,
                                        label_selector=label_selector, field_selector=field_selector,
                                        timeout=timeout, not_older_than=not_older_than))
        items: list[JSON] = []
        listed: JSON = {}
        for listed in self.list_pages(res, namespace=namespace, all_namespaces=all_namespaces,
                                      label_selector=label_selector, field_selector=field_selector,
                                      timeout=timeout, not_older_than=not_older_than):
            items.extend(listed.get("items", []))
        return {**listed, "items": items}

    def list_pages(self, res: Resource, *, namespace: str | None = None, all_namespaces: bool = False,
                   label_selector: str = "", field_selector: str = "", limit: int = _PAGE,
                   timeout: float = 30, start: str = "", stream: bool = False,
                   not_older_than: str = "") -> Iterator[JSON]:
        """A LIST in pages of at most `limit` objects (`limit`/`continue`), all from one snapshot:
        the server never builds, and we never hold, one answer for a whole large queue. A
        snapshot compacted mid-way raises Gone, whose `resume` lists the rest when passed as
        `start` (a continue token to begin from). With `stream`, each page's `items` is an
        iterator that decodes them one at a time (`decode.loads_page`): the caller iterates it to
        its end before it asks for the next page. With `not_older_than` (a resourceVersion), the
        snapshot is the watch cache's once it has reached that version, not a consistent read."""
        ns = None if all_namespaces else (namespace or self.namespace)
        base: dict[str, Any] = {**_selectors(label_selector, field_selector), "limit": limit}
        query = {**base, "continue": start} if start else dict(base)
        if not start and not_older_than:
            query.update(resourceVersion=not_older_than, resourceVersionMatch="NotOlderThan")
        while True:
            page = self._page(res.path(ns), query, timeout) if stream else \
                self.request("GET", res.path(ns), query=query, timeout=timeout)
            yield page
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return
            query = {**base, "continue": token}  # the token names the snapshot: no version with it

    def _page(self, path: str, query: dict[str, Any], timeout: float) -> JSON:
        resp = self._send("GET", path, query=query, body=None, content_type="application/json", timeout=timeout)
        try:
            data = resp.data or b"{}"
        finally:
            resp.release_conn()
        try:
            return decode.loads_page(data)
        except ValueError:
            raise _foreign(self.connection.host, resp.status, data) from None

    def create(self, res: Resource, body: JSON, *, namespace: str | None = None, timeout: float = 30) -> JSON:
        return self.request("POST", res.path(namespace or self.namespace), body=body, query=_STRICT, timeout=timeout)

    def replace(self, res: Resource, body: JSON, *, sub: str | None = None, timeout: float = 30) -> JSON:
        """A PUT that carries metadata.resourceVersion: the API server answers 409 if it moved."""
        meta = body["metadata"]
        return self.request("PUT", res.path(meta["namespace"], meta["name"], sub), body=body, query=_STRICT,
                            timeout=timeout)

    def merge_patch(self, res: Resource, name: str, patch: JSON, *, namespace: str | None = None,
                    timeout: float = 30) -> JSON:
        """Never creates (404 when absent); conditional when `patch` carries metadata.resourceVersion."""
        return self.request("PATCH", res.path(namespace or self.namespace, name), body=patch,
                            content_type="application/merge-patch+json", query=_STRICT, timeout=timeout)

    def delete(self, res: Resource, name: str, *, namespace: str | None = None,
               preconditions: JSON | None = None) -> None:
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "preconditions": preconditions} if preconditions else None
        self.request("DELETE", res.path(namespace or self.namespace, name), body=body)

    def watch(self, res: Resource, *, namespace: str | None, resource_version: str,
              label_selector: str = "", field_selector: str = "", timeout_s: int = 300,
              initial_events: bool = False, hangup: Hangup | None = None,
              quiet_s: float = _WATCH_READ_TIMEOUT_S, batch_s: float = 0.0) -> Generator[JSON, None, None]:
        """Stream watch events from `resource_version` until the server closes the stream. With
        `initial_events`, the stream starts with an ADDED event for every selected object as of
        a version not older than `resource_version` ("0": any the server's watch cache has),
        then a BOOKMARK annotated `INITIAL_EVENTS_END` (a streaming list, `sendInitialEvents`).
        `hangup`: another thread's way to end it at once (then it ends as if the server had).
        `quiet_s`: it ends too after that long without a byte (`timeout_s` is whole seconds).
        `batch_s`: after a read that brought events, when nothing more has arrived, wait that
        long before reading on: the events of a busy stream are read a batch per wake-up of
        this thread instead of one each (every process that watches a busy resource pays a
        wake-up per read), none later than `batch_s` after it arrived, and one after a quiet
        spell at once (the reader waits in its read then, not in a pause)."""
        query = {"watch": "true", "resourceVersion": resource_version, "allowWatchBookmarks": "true",
                 "timeoutSeconds": timeout_s, **_selectors(label_selector, field_selector)}
        if initial_events:
            query.update(sendInitialEvents="true", resourceVersionMatch="NotOlderThan")
        resp = self._send("GET", res.path(namespace), query=query, body=None, content_type="application/json",
                          timeout=(10, quiet_s))
        # Read the bytes under http.client's response and undo the chunked encoding here
        # (`chunked`): urllib3's `stream` adds a third to the CPU of every event, http.client's
        # own decoding reads an event per call, and every agent of a queue reads every event
        # of its Tasks. A response that is not chunked is read through http.client, unbatched.
        raw: http.client.HTTPResponse = resp._fp  # type: ignore[attr-defined]
        dechunk = chunked.Dechunker() if raw.chunked and raw.fp is not None else None
        read = raw.fp.read1 if dechunk is not None else raw.read1
        buffer = b""
        ended = busy = False
        if hangup is not None:
            hangup._attach(resp)
        sock = getattr(getattr(resp, "connection", None), "sock", None) if batch_s and dechunk else None
        try:
            while True:
                # Never inside an event: every byte read is in `buffer`, so the socket shows
                # whether anything else has arrived.
                if sock is not None and busy and not buffer and not _arrived(sock):
                    time.sleep(batch_s)
                busy = False
                data = read(_WATCH_READ_BYTES)
                if not data:
                    if dechunk is not None:  # closed before its last chunk
                        raise http.client.IncompleteRead(buffer)
                    break
                if dechunk is not None:
                    data = dechunk.feed(data)
                buffer += data
                if b"\n" in data:
                    busy = True
                    *lines, buffer = buffer.split(b"\n")
                    for line in lines:
                        if line.strip():
                            yield decode.loads(line)
                if dechunk is not None and dechunk.ended:
                    raw.close()  # as http.client does at a body's end: the connection serves on
                    break
            ended = True
        except TimeoutError as exc:
            if initial_events:  # a list cut short, not a quiet watch
                raise errors.Unreachable(f"watch interrupted: {_short(exc)}") from None
            # Nothing, not even a bookmark, for the read timeout: it ends as if the server had
            # closed it, and is resumed from the last version seen.
            return
        except (http.client.HTTPException, OSError, chunked.MalformedChunk) as exc:
            if hangup is not None and hangup.hung_up:
                return
            raise errors.Unreachable(f"watch interrupted: {_short(exc)}") from None
        finally:
            if hangup is not None:
                hangup._detach()  # from here on, a hangup cannot shut this connection
            if not ended or (hangup is not None and hangup.hung_up):
                # Left before the server ended it (the reader stopped, or the read failed), or
                # shut down by a hangup: no other request may use this connection.
                resp.close()
            resp.release_conn()


def _arrived(sock: socket.socket) -> bool:
    """Whether a read of `sock` would return at once: TLS has bytes decrypted, or the kernel
    has some (True where that cannot be asked: no wait then)."""
    pending = getattr(sock, "pending", None)  # TLS only
    if (pending is not None and pending()) or not hasattr(select, "poll"):
        return True
    poller = select.poll()  # not select(): it fails on descriptors past 1023
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


def _error_for(status: int, body: bytes, *, path: str, host: str) -> errors.TaskleaseError:
    # The API server says why in a Status object, but for its plain 404 of a path it does not
    # serve. Other answers come from another server (a web server, or a TLS port asked in plain
    # HTTP), except what a proxy before an API server says in its own words: who may not (401,
    # 403), too large (413), and a 429 or 5xx, still worth a retry.
    if not _status(body) and status not in (401, 403, 413, 429) and status < 500 and not (
            status == 404 and body.strip() == _NOT_SERVED):
        return _foreign(host, status, body)
    message = _message(body)
    if status == 409:
        return errors.Conflict(message)
    if status == 404:
        # A resource the server does not serve answers with a plain 404, not a Status about an object.
        if path.startswith(TASKS.path(None).rsplit("/", 1)[0]) and (
                "could not find the requested resource" in message or "page not found" in message):
            kind, plural = (("TaskQueue", resource.QUEUE_PLURAL) if resource.QUEUE_PLURAL in path.split("/")
                            else ("Task", resource.PLURAL))
            return errors.CRDMissing(f"the {kind} CRD ({plural}.{resource.GROUP}) is not installed in this "
                                     "cluster: kubectl apply -f crds/")
        return errors.NotFound(message)
    if status == 403 and _ADMISSION_DENIED in message:
        return errors.Refused(message)
    if status in (401, 403):
        return errors.Forbidden(message)
    if status in (400, 413, 422):  # 413: larger than the API server takes
        return errors.Invalid(message)
    if status == 410:
        return errors.Gone(message, resume=_status(body).get("metadata", {}).get("continue", ""))
    if status == 429 or status >= 500:
        return errors.ServerError(f"{status}: {message}")
    return errors.TaskleaseError(f"{status}: {message}")


def _foreign(host: str, status: int, body: bytes) -> errors.WrongServer:
    """An answer that is not the Kubernetes API's: the kubeconfig names another server, or the wrong scheme."""
    said = body.decode(errors="replace").strip().partition("\n")[0]
    return errors.WrongServer(f"{host} does not answer as the Kubernetes API server does (HTTP {status}: "
                              f"{_short(said) or 'an empty answer'})")


def _selectors(label_selector: str, field_selector: str) -> dict[str, str]:
    query = {}
    if label_selector:
        query["labelSelector"] = label_selector
    if field_selector:
        query["fieldSelector"] = field_selector
    return query


def _message(body: bytes) -> str:
    return str(_status(body).get("message") or body.decode(errors="replace").strip())


def _status(body: bytes) -> JSON:
    """The Status object an error answer carries; empty when it carries none (a proxy's page)."""
    try:
        status = json.loads(body)
    except ValueError:
        return {}
    return status if isinstance(status, dict) and status.get("kind") == "Status" else {}


def _short(said: BaseException | str) -> str:
    text = str(said)
    return text if len(text) < 200 else text[:200] + "..."

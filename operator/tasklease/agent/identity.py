"""Who an agent is: `<pod>/<instance>[@<pod uid>]`, and whether an instance of this pod is gone."""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

from tasklease.api import errors
from tasklease.protocol import record

_CONTAINER = re.compile(r"[A-Za-z0-9._-]+")  # no '/', ':' or '@': they separate a holder's parts
SA_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")


@dataclass(frozen=True)
class Identity:
    """`<pod>/<instance>[@<pod uid>]`: the pod survives restarts of the process, the instance does not.

    The instance is `[<container>:]<pid>.<start time>.<random>`, so that an agent starting
    in a pod can tell a dead predecessor (release its leases at once) from a live sibling
    process in the same container (leave it alone). Agents in *different* containers of one
    pod cannot see each other's processes: each container names itself (TASKLEASE_AGENT_ID),
    and an agent judges only the instances of its own container. The pod part stays the
    pod's name, which the chart's admission policy and the operator's pod-gone path expect.

    The pod's uid (POD_UID, from the downward API) tells this pod from an earlier or later
    one of the same name (a StatefulSet's): the operator requeues a holder's tasks when *its*
    Pod goes, never because an older namesake went."""

    pod: str
    instance: str
    pod_uid: str = ""

    @classmethod
    def from_environment(cls, *, handed_over: bool = False) -> Identity:
        """`handed_over`: for a claim passed on to a shell script (`tasklease claim`), whose
        process lives on after ours: `start()` of a later agent in this pod never releases it
        (one in a later pod of the same name, another POD_UID, does: that pod is gone)."""
        pod = os.environ.get("POD_NAME") or socket.gethostname()
        pod_uid = os.environ.get("POD_UID", "")
        container = os.environ.get("TASKLEASE_AGENT_ID", "")
        if container and not _CONTAINER.fullmatch(container):
            raise errors.Invalid(f"TASKLEASE_AGENT_ID={container!r}: use letters, digits, '.', '_' and '-' "
                                 "(it names this container within its pod)")
        prefix = f"{container}:" if container else ""
        if handed_over:
            return cls(pod=pod, instance=f"{prefix}shell.{uuid.uuid4().hex[:8]}", pod_uid=pod_uid)
        pid = os.getpid()
        return cls(pod=pod, instance=f"{prefix}{pid}.{_start_ticks(pid)}.{uuid.uuid4().hex[:4]}", pod_uid=pod_uid)

    @property
    def holder(self) -> str:
        return f"{self.pod}/{self.instance}" + (f"@{record.short_uid(self.pod_uid)}" if self.pod_uid else "")


def own_pod_uid(token: Path = SA_TOKEN) -> str:
    """This Pod's uid: POD_UID (the downward API), else the claims of the Pod-bound
    ServiceAccount token Kubernetes mounts (`kubernetes.io.pod.uid`); "" when neither says.
    The token is only read here, never trusted: the API server checks it on every request."""
    if uid := os.environ.get("POD_UID", ""):
        return uid
    try:
        claims = token.read_text().strip().split(".")[1]
        decoded = json.loads(base64.urlsafe_b64decode(claims + "=" * (-len(claims) % 4)))
        return str(decoded["kubernetes.io"]["pod"]["uid"])
    except (OSError, IndexError, ValueError, binascii.Error, KeyError, TypeError):
        return ""


def container_of(instance: str) -> str:
    """`[<container>:]<process part>` → `<container>`; "" for an agent that names none."""
    return instance.rpartition(":")[0]


def instance_gone(instance: str) -> bool:
    """True only when we know the process that used `instance` no longer runs here: its pid
    is free or reused (another start time). Anything else (a `tasklease claim` whose shell
    script carries on, a start time this system cannot tell) counts as alive. The caller
    asks only about instances of its own container: another container's pids mean nothing here."""
    pid, _, rest = instance.rpartition(":")[2].partition(".")
    ticks = rest.partition(".")[0]
    if not pid.isdigit() or not ticks.isdigit() or not _start_ticks(os.getpid()):
        return False
    state, started = _stat(int(pid))
    # A zombie (exited, not yet reaped by its parent) runs no more code: it is gone.
    return started != ticks or state in ("Z", "X")


def _start_ticks(pid: int) -> str:
    return _stat(pid)[1]


def _stat(pid: int) -> tuple[str, str]:
    """(state, start time in clock ticks) of `pid` from /proc; empty strings when unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], fields[19]
    except (OSError, IndexError):
        return "", ""

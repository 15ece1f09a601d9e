"""Errors as types, each with the CLI exit code documented in the README.

One class per answer the protocol must tell apart; never a bool or a string to parse.
"""

from __future__ import annotations

from typing import ClassVar


class TaskleaseError(Exception):
    """Base class: `exit_code` is what `tasklease` exits with when this ends a command."""

    exit_code: ClassVar[int] = 1


class NothingToClaim(TaskleaseError):
    exit_code = 3


class LostLease(TaskleaseError):
    """The caller no longer holds the task: expired, cancelled, taken over or deleted."""

    exit_code = 4


class NotFound(TaskleaseError):
    exit_code = 5


class Forbidden(TaskleaseError):
    """RBAC (403) or authentication (401) said no."""

    exit_code = 6


class Unreachable(TaskleaseError):
    """No cluster configuration, or the API server does not answer."""

    exit_code = 7


class CRDMissing(TaskleaseError):
    exit_code = 8


class Invalid(TaskleaseError):
    """The API server refused the object (422), or the request makes no sense in the task's state."""

    exit_code = 9


class NotClaimable(Invalid):
    """The task cannot be claimed in its current state (decided before any write)."""


class Conflict(TaskleaseError):
    """409: the object moved since it was read (or already exists). Somebody else's write won."""

    exit_code = 10


class Gone(TaskleaseError):
    """410: a watch asked for a resourceVersion the server no longer keeps: list again."""


class ServerError(TaskleaseError):
    """5xx or 429: transient, worth a retry."""


def from_status(status: int, message: str, *, path: str) -> TaskleaseError:
    if status == 409:
        return Conflict(message)
    if status == 404:
        # A missing resource answers with a plain 404, not a Status about an object.
        if "/apis/tasklease.dev/" in path and ("could not find the requested resource" in message
                                               or "page not found" in message):
            return CRDMissing("the Task CRD (tasks.tasklease.dev) is not installed in this cluster: "
                              "kubectl apply -f crds/")
        return NotFound(message)
    if status in (401, 403):
        return Forbidden(message)
    if status == 422 or status == 400:
        return Invalid(message)
    if status == 410:
        return Gone(message)
    if status == 0:
        return Unreachable(message or "cannot reach the Kubernetes API server")
    if status == 429 or status >= 500:
        return ServerError(f"{status}: {message}")
    return TaskleaseError(f"{status}: {message}")

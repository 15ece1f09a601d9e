"""Errors as types, and the one table of `tasklease` exit codes.

One class per answer the protocol must tell apart; never a bool or a string to parse.
Each class carries its exit code and what it means; `exit_codes()` adds the codes that
are not errors. The CLI's help is made from it and a test checks docs/shell-agents.md against it.
"""

from __future__ import annotations

from typing import ClassVar, Final


class TaskleaseError(Exception):
    """Base class: `exit_code` is what `tasklease` exits with when this ends a command."""

    exit_code: ClassVar[int] = 1
    meaning: ClassVar[str] = "unexpected error"


class BadArguments(TaskleaseError):
    """What was asked cannot be done as given (a command `run` cannot start, a live view
    without a terminal): found before anything was changed, or with what was taken given back."""

    exit_code = 2
    meaning = "bad flags"


class NothingToClaim(TaskleaseError):
    exit_code = 3
    meaning = "nothing claimable"


class LostLease(TaskleaseError):
    """The caller no longer holds the task: expired, cancelled, taken over or deleted."""

    exit_code = 4
    meaning = "lost ownership (expired, cancelled, taken over)"


class NotFound(TaskleaseError):
    exit_code = 5
    meaning = "no such task (or namespace)"


class Forbidden(TaskleaseError):
    """RBAC (403) or authentication (401) said no."""

    exit_code = 6
    meaning = "forbidden (RBAC)"


class Unreachable(TaskleaseError):
    """No cluster configuration, or the API server does not answer."""

    exit_code = 7
    meaning = "no cluster reachable / no configuration"


class CRDMissing(TaskleaseError):
    exit_code = 8
    meaning = "the Task CRD is not installed"


class WrongServer(TaskleaseError):
    """The server named answers, but not as a Kubernetes API server does (another server, or
    plain HTTP to a TLS port): no retry will change that."""

    exit_code = 7
    meaning = "no cluster reachable / no configuration"


class Invalid(TaskleaseError):
    """The API server refused the object (422), or the request makes no sense in the task's state."""

    exit_code = 9
    meaning = "refused: invalid task, or not possible in its state"


class Refused(Invalid):
    """An admission policy refused this one write (403) because of what the object already
    is, not because of what we wrote or who we are (those are `Invalid`, 422): to a claim,
    one lost candidate (`policy.py` says which rules are which)."""


class NotClaimable(Invalid):
    """The task cannot be claimed in its current state (decided before any write)."""


class Conflict(TaskleaseError):
    """409: the object moved since it was read (or already exists). Somebody else's write won."""

    exit_code = 10
    meaning = "conflict"


class Gone(TaskleaseError):
    """410: a watch asked for a resourceVersion the server no longer keeps: list again. A
    paginated list whose snapshot was compacted part-way answers 410 too, with `resume`: a
    continue token for the rest of the list at the server's current version."""

    def __init__(self, message: str, *, resume: str = "") -> None:
        super().__init__(message)
        self.resume = resume


class ServerError(TaskleaseError):
    """5xx or 429: transient, worth a retry."""


RUN_COMMAND_FAILED: Final = 11
RUN_STOPPED: Final = 143  # 128 + SIGTERM, as a shell reports a process ended by it
INTERRUPTED: Final = 130  # 128 + SIGINT
_NOT_ERRORS: Final = {
    0: "ok",
    2: "bad flags",
    INTERRUPTED: "interrupted (Ctrl-C)",
    RUN_COMMAND_FAILED: "`run`: the command failed (the failure is recorded)",
    RUN_STOPPED: "`run`: stopped by SIGTERM/SIGINT (the task was released)",
}


def exit_codes() -> list[tuple[int, str]]:
    """Every exit code of `tasklease`, in order: the error classes' and the others."""
    codes = dict(_NOT_ERRORS)
    pending: list[type[TaskleaseError]] = [TaskleaseError]
    while pending:
        cls = pending.pop()
        codes.setdefault(cls.exit_code, cls.meaning)
        pending.extend(cls.__subclasses__())
    return sorted(codes.items())

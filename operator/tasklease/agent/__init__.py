"""The agent SDK: claim, renew, finish, and stop the work when ownership is lost.

`tasklease run` (the `runner`) is built on it.

Rule: talks to Leases only through `tasklease.protocol`; never imports
`tasklease.operator`, because agents keep claiming and finishing while no operator runs.

What users import is listed in `__all__`; every other name here is private by convention.
"""

from tasklease.agent.sdk import Agent, ClaimedTask, Identity
from tasklease.api.errors import (
    Conflict,
    CRDMissing,
    Forbidden,
    Invalid,
    LostLease,
    NotClaimable,
    NotFound,
    NothingToClaim,
    ServerError,
    TaskleaseError,
    Unreachable,
)

__all__ = [
    "Agent", "ClaimedTask", "Identity",
    "CRDMissing", "Conflict", "Forbidden", "Invalid", "LostLease", "NotClaimable", "NotFound", "NothingToClaim",
    "ServerError", "TaskleaseError", "Unreachable",
]

"""The agent SDK: claim, renew, finish, and tell the work when ownership is lost.

`tasklease run` (the `runner`) is built on it; `producer` creates and follows tasks; `aio`
is the asyncio variant of the agent loop.

Rule: talks to Leases only through `tasklease.protocol`; never imports
`tasklease.operator`, because agents keep claiming and finishing while no operator runs.

What users import is listed in `__all__`; every other name here is private by convention.
"""

from tasklease.agent.aio import AsyncAgent, AsyncClaimedTask, AsyncProducer
from tasklease.agent.producer import Producer, Task
from tasklease.agent.sdk import Agent, AgentSettings, ClaimedTask, Identity
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
    "Agent", "AgentSettings", "AsyncAgent", "AsyncClaimedTask", "AsyncProducer", "ClaimedTask", "Identity",
    "Producer", "Task",
    "CRDMissing", "Conflict", "Forbidden", "Invalid", "LostLease", "NotClaimable", "NotFound", "NothingToClaim",
    "ServerError", "TaskleaseError", "Unreachable",
]

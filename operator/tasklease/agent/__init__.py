"""The agent SDK: claim, renew, finish, and tell the work when ownership is lost.

`tasklease run` (the `runner`) is built on it; `producer` creates and follows tasks; `aio`
is the asyncio variant of the agent loop.

Rule: talks to Leases only through `tasklease.protocol`; never imports
`tasklease.operator`, because agents keep claiming and finishing while no operator runs.

What users import is listed in `__all__`; every other name here is private by convention.
"""

import importlib
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from tasklease.agent.aio import AsyncAgent, AsyncClaimedTask, AsyncProducer
    from tasklease.agent.producer import Producer, Task

# Imported when first used: an agent that only claims needs neither asyncio nor the producer.
_LAZY = {"AsyncAgent": "aio", "AsyncClaimedTask": "aio", "AsyncProducer": "aio", "Producer": "producer",
         "Task": "producer"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


"""The claim protocol: every Lease transition, and nothing else.

Rule: only this package writes Leases (task Leases, orphan removal, the operator's election
Lease and the agents' member Leases alike), each write conditional on what was read: task
and election Leases through `record.encode`. `rules` is pure; `transitions`, `election` and
`members` do the writes.
"""

from tasklease.protocol.record import CLOSED, FREE, HELD, LeaseRecord
from tasklease.protocol.rules import TaskView, why_not_claimable
from tasklease.protocol.transitions import Held, Protocol

__all__ = ["CLOSED", "FREE", "HELD", "Held", "LeaseRecord", "Protocol", "TaskView", "why_not_claimable"]

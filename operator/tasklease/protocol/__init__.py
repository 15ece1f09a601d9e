"""The claim protocol: every Lease transition, and nothing else.

Rule: only this package writes Leases (task Leases, orphan removal and the operator's
election Lease alike), each write through `record.encode` and conditional on what was
read. `rules` is pure; `transitions` and `election` do the writes.
"""

from tasklease.protocol.record import CLOSED, FREE, HELD, LeaseRecord
from tasklease.protocol.rules import TaskView, why_not_claimable
from tasklease.protocol.transitions import Held, Protocol

__all__ = ["CLOSED", "FREE", "HELD", "Held", "LeaseRecord", "Protocol", "TaskView", "why_not_claimable"]

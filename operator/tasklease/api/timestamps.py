"""Time on the wire: RFC 3339 in UTC, microseconds, `Z`. One format for every writer.

`Clock` is injected wherever a decision depends on wall time, so tests pin it.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

def now_utc() -> datetime:
    return datetime.now(UTC)


Clock = Callable[[], datetime]


def parse_time(value: Any) -> datetime | None:
    if not value:
        return None
    return datetime.fromisoformat(str(value).replace("Z", "+00:00"))


def format_time(value: datetime | None) -> str | None:
    if value is None:
        return None
    if value.tzinfo is not UTC:
        value = value.astimezone(UTC)
    return value.isoformat(timespec="microseconds")[:-6] + "Z"  # "+00:00" → "Z"; faster than strftime


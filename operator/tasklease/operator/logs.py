"""`--log-format json`: one JSON object a line, for log collectors that index fields.

Each line has `time` (RFC 3339, UTC, milliseconds), `level`, `logger` and `message`, and
`exception` (the formatted traceback) when there is one. The text format stays the default:
it is what a person reads in `kubectl logs`.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime

FORMATS = ("text", "json")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {"time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
                .replace("+00:00", "Z"),
                "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        return json.dumps(line, ensure_ascii=False)


def use_format(name: str) -> None:
    """Give the root logger's handlers (the CLI's, made by `logging.basicConfig`) `name`'s format."""
    if name == "json":
        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonFormatter())

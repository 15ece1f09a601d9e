"""The operator's log lines: text (the default, what a person reads in `kubectl logs`) or,
with `--log-format json`, one JSON object a line, for log collectors that index fields.

A JSON line has `time` (RFC 3339, UTC, milliseconds), `level`, `logger` and `message`, and
`exception` (the formatted traceback) when there is one. A text line's message has its
control characters escaped: what an agent wrote (a holder, a reason) is in many messages,
and a newline in it would otherwise start a line of its own, one that reads as the operator's.
"""

from __future__ import annotations

import json
import logging
import re
from datetime import UTC, datetime

FORMATS = ("text", "json")
TEXT_LINE = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # the CLI's lines too (`logging.basicConfig`)
_CONTROL = re.compile("[\x00-\x08\x0a-\x1f\x7f\u0085\u2028\u2029]")  # a tab stays a tab


class TextFormatter(logging.Formatter):
    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        record.message = _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode(), record.message)
        return super().formatMessage(record)


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
    for handler in logging.getLogger().handlers:
        handler.setFormatter(JsonFormatter() if name == "json" else TextFormatter(TEXT_LINE))

"""`tasklease operator --log-format json`: every line a JSON object with time, level, logger
and message (and the traceback when there is one)."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable

from conftest import Operator
from test_chart import CHART, _helm, by_kind, render
from tasklease.operator.logs import JsonFormatter, TextFormatter


def test_a_record_with_a_traceback_is_one_json_line() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("tasklease.operator", logging.ERROR, __file__, 1, "task %s/%s: failed",
                                   ("shop", "t1"), sys.exc_info())
    line = JsonFormatter().format(record)
    assert "\n" not in line
    parsed = json.loads(line)
    assert parsed["level"] == "error" and parsed["logger"] == "tasklease.operator"
    assert parsed["message"] == "task shop/t1: failed"
    assert parsed["time"].endswith("Z") and "ValueError: boom" in parsed["exception"]


def test_what_an_agent_wrote_cannot_start_a_text_line_of_its_own() -> None:
    holder = "evil\nWARNING tasklease.operator: forged\r\x07\u2028/1"
    record = logging.LogRecord("tasklease.operator", logging.WARNING, __file__, 1, "lease %s: expired", (holder,),
                               None)
    line = TextFormatter("%(levelname)s %(name)s: %(message)s").format(record)
    assert line == ("WARNING tasklease.operator: lease evil\\nWARNING tasklease.operator: forged"
                    "\\r\\x07\\u2028/1: expired")
    assert len(line.splitlines()) == 1


def test_the_operator_logs_json_lines(operator_factory: Callable[..., Operator]) -> None:
    op = operator_factory("--no-leader-elect", "--log-format=json")
    lines = [line for line in op.output().splitlines() if line.strip()]
    assert any("serving /metrics" in line for line in lines), lines
    for line in lines:
        parsed = json.loads(line)
        assert {"time", "level", "logger", "message"} <= parsed.keys(), line
    assert any(json.loads(line)["logger"] == "tasklease.operator" for line in lines)


def test_the_chart_passes_the_log_format_and_refuses_an_unknown_one() -> None:
    def args(*sets: str) -> list[str]:
        return list(by_kind(render(*sets), "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"])
    assert not [a for a in args() if a.startswith("--log-format")]
    assert "--log-format=json" in args("operator.logFormat=json")
    done = _helm("template", "rel", str(CHART), "--set", "operator.logFormat=xml")
    assert done.returncode != 0 and "logFormat" in done.stderr, done.stderr

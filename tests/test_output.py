"""The CLI's formats, pure: tables, json/yaml without managedFields, name, jsonpath."""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime

import pytest
import yaml

from tasklease.api import errors
from tasklease.cli import output

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def _task(name: str, phase: str | None = None, **status: object) -> dict[str, object]:
    task: dict[str, object] = {
        "apiVersion": "tasklease.dev/v1alpha1", "kind": "Task",
        "metadata": {"name": name, "namespace": "ns", "creationTimestamp": "2026-01-01T11:58:00Z",
                     "managedFields": [{"manager": "kubectl"}]},
        "spec": {"queue": "q", "priority": 0, "maxAttempts": 3}}
    if phase:
        task["status"] = {"phase": phase, "attempt": 1, **status}
    return task


def test_a_task_the_operator_has_not_seen_shows_no_phase() -> None:
    text = output.table([_task("fresh"), _task("done", "Succeeded")], now=NOW)
    lines = text.splitlines()
    assert lines[0].split() == ["NAME", "QUEUE", "PHASE", "HOLDER", "ATTEMPT", "AGE"]
    assert lines[1].split() == ["fresh", "q", "<none>", "<none>", "0", "2m"]
    assert lines[2].split()[2] == "Succeeded"


def test_wide_adds_reason_and_the_first_line_of_the_error() -> None:
    text = output.render([_task("t", "Failed", reason="DeadLettered", lastError="sh exited\nmore")], "wide",
                         single=False, now=NOW)
    assert "DeadLettered" in text and "sh exited" in text and "more" not in text
    assert "NOT-BEFORE" in text.splitlines()[0]


def test_json_and_yaml_drop_managed_fields() -> None:
    as_json = json.loads(output.render([_task("t")], "json", single=True))
    assert "managedFields" not in as_json["metadata"] and as_json["metadata"]["name"] == "t"
    as_list = yaml.safe_load(output.render([_task("a"), _task("b")], "yaml", single=False))
    assert as_list["kind"] == "List" and [i["metadata"]["name"] for i in as_list["items"]] == ["a", "b"]
    assert all("managedFields" not in i["metadata"] for i in as_list["items"])


def test_name_and_jsonpath() -> None:
    tasks = [_task("a", "Failed"), _task("b", "Running")]
    assert output.render(tasks, "name", single=False) == "task.tasklease.dev/a\ntask.tasklease.dev/b"
    assert output.render(tasks, "jsonpath={.items[*].metadata.name}", single=False) == "a b"
    ranged = output.render(tasks, "jsonpath={range .items[*]}{.metadata.name}={.status.phase}{'\\n'}{end}",
                           single=False)
    assert ranged == "a=Failed\nb=Running\n"
    assert output.render(tasks[:1], "jsonpath={.status.phase}", single=True) == "Failed"
    assert output.render(tasks[:1], "jsonpath={.status.missing}", single=True) == ""
    with pytest.raises(errors.Invalid):
        output.jsonpath({}, "{range .items[*]}{.x}")


def test_jsonpath_filters_as_kubectl_does() -> None:
    tasks = [_task("a", "Failed"), _task("b", "Running"), _task("c", "Failed")]
    failed = output.render(tasks, 'jsonpath={.items[?(@.status.phase=="Failed")].metadata.name}', single=False)
    assert failed == "a c"
    assert output.render(tasks, "jsonpath={.items[?(@.status.phase!='Failed')].metadata.name}",
                         single=False) == "b"
    assert output.render(tasks, "jsonpath={.items[?(@.status.missing)].metadata.name}", single=False) == ""
    assert output.jsonpath({"items": [{"n": 1}, {"n": 5}, {"n": "x"}]}, "{.items[?(@.n > 2)].n}") == "5"
    assert output.jsonpath({"items": [{"n": 1}, {"n": 5}]}, "{range .items[*]}{@.n};{end}") == "1;5;"
    assert output.jsonpath({"a": 1}, "{$.a}") == "1"
    assert output.jsonpath({"a": 1}, "{.}") == '{"a":1}'


@pytest.mark.parametrize("template", ["{.status.phase", ".status.phase}", "{status}", "{.items[0].a b}",
                                      "{.items[?(@.a ~ 1)]}", "{.items[?(@.a==Failed)]}",
                                      "{..a}"])
def test_jsonpath_it_cannot_read_is_an_error_not_text(template: str) -> None:
    """kubectl fails on these; printing nothing, or the template, would read as an answer."""
    with pytest.raises(errors.Invalid, match="jsonpath"):
        output.jsonpath({"status": {"phase": "Failed"}, "items": [{"a": 1}]}, template)


def test_unknown_formats_are_refused() -> None:
    assert output.check_format("jsonpath={.a}") == "jsonpath={.a}"
    for bad in ("xml", "jsonpath=", "custom-columns=A:.a"):
        with pytest.raises(argparse.ArgumentTypeError, match="unknown output format"):
            output.check_format(bad)

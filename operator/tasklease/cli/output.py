"""How the CLI prints Tasks: tables (default and wide), json, yaml, name, jsonpath; as kubectl does.

Pure apart from `print`: every formatter takes the objects and returns text, so it is
tested without a cluster. managedFields are dropped: they are the API server's bookkeeping.
"""

from __future__ import annotations

import argparse
import json
import operator
import re
from collections.abc import Iterable
from datetime import datetime
from typing import Any

import yaml

from tasklease.api import errors, models, timestamps

JSON = dict[str, Any]
FORMATS = ("wide", "json", "yaml", "name")
_NONE = "<none>"


def check_format(value: str) -> str:
    """argparse `type=`: one of FORMATS, or `jsonpath=TEMPLATE`."""
    if value in FORMATS or (value.startswith("jsonpath=") and len(value) > len("jsonpath=")):
        return value
    raise argparse.ArgumentTypeError(f"unknown output format {value!r} (use {', '.join(FORMATS)} or jsonpath=TEMPLATE)")


def clean(obj: JSON) -> JSON:
    """A copy of `obj` without metadata.managedFields."""
    meta = {k: v for k, v in (obj.get("metadata") or {}).items() if k != "managedFields"}
    return {**obj, "metadata": meta}


def render(objects: list[JSON], fmt: str | None, *, single: bool, all_namespaces: bool = False,
           now: datetime | None = None) -> str:
    """`objects` in format `fmt` (None: the table). `single`: one object (get), not a List."""
    items = [clean(o) for o in objects]
    doc: Any = items[0] if single else {"apiVersion": "v1", "kind": "List", "items": items, "metadata": {}}
    if fmt == "json":
        return json.dumps(doc, indent=2)
    if fmt == "yaml":
        return yaml.safe_dump(doc, sort_keys=False).rstrip("\n")
    if fmt == "name":
        return "\n".join(f"task.{models.GROUP}/{o['metadata']['name']}" for o in items)
    if fmt is not None and fmt.startswith("jsonpath="):
        return jsonpath(doc, fmt[len("jsonpath="):])
    return table(items, wide=fmt == "wide", all_namespaces=all_namespaces, now=now)


def table(tasks: Iterable[JSON], *, wide: bool = False, all_namespaces: bool = False, header: bool = True,
          now: datetime | None = None) -> str:
    """The table of `tasks`; empty (no header either) when there are none, as kubectl does."""
    body = [row(t, wide=wide, all_namespaces=all_namespaces, now=now) for t in tasks]
    if not body:
        return ""
    return format_rows(([header_row(wide=wide, all_namespaces=all_namespaces)] if header else []) + body)


def header_row(*, wide: bool, all_namespaces: bool) -> list[str]:
    head = ["NAMESPACE"] if all_namespaces else []
    head += ["NAME", "QUEUE", "PHASE", "HOLDER", "ATTEMPT", "AGE"]
    return head + (["NOT-BEFORE", "PRIORITY", "MAX", "REASON", "ERROR"] if wide else [])


def row(task: JSON, *, wide: bool, all_namespaces: bool, now: datetime | None = None) -> list[str]:
    """One task. The phase is what the operator projected, exactly as `kubectl get tasks`
    shows it: a task the operator has not seen yet has none."""
    meta, spec, status = task["metadata"], task.get("spec") or {}, task.get("status") or {}
    cells = [meta["namespace"]] if all_namespaces else []
    cells += [meta["name"], spec.get("queue", ""), status.get("phase") or _NONE, status.get("holder") or _NONE,
              str(status.get("attempt", 0)), age(meta.get("creationTimestamp", ""), now)]
    if wide:
        error = (status.get("lastError") or "").splitlines()
        cells += [spec.get("notBefore") or _NONE, str(spec.get("priority", 0)), str(spec.get("maxAttempts", "")),
                  status.get("reason") or _NONE, error[0][:60] if error else _NONE]
    return cells


def format_rows(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("   ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def age(timestamp: str, now: datetime | None = None) -> str:
    now = now or timestamps.now_utc()
    seconds = int((now - (timestamps.parse_time(timestamp) or now)).total_seconds())
    return duration(seconds)


def duration(seconds: float) -> str:
    seconds = int(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


# -- jsonpath: kubectl's template subset (fields, [n], [*], [?()], {range}...{end}) --------------

_TOKEN = re.compile(r"\{([^{}]*)\}")
_STEP = re.compile(r"\.([^.\[\]\s]*)|\[([^\]]*)\]")
# A filter's test: `@.path`, alone (it exists) or compared with a literal.
_FILTER = re.compile(r"\?\(\s*@((?:\.[^.\[\]\s=!<>)]+)*)\s*(?:(==|!=|<=|>=|<|>)\s*(.+?))?\s*\)")
_COMPARE: dict[str, Any] = {"==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le,
                            ">": operator.gt, ">=": operator.ge}


def jsonpath(doc: Any, template: str) -> str:
    """kubectl's `-o jsonpath=`: `{.a.b}`, `{.items[*].metadata.name}`, `{.items[0]}`,
    `{.items[?(@.status.phase=="Failed")].metadata.name}`, `{range .items[*]}...{end}`, and
    literal text with `\\n` and `\\t`. What it cannot read is Invalid, never printed as is."""
    out: list[str] = []
    _expand(doc, _parse(template.replace("\\n", "\n").replace("\\t", "\t")), out)
    return "".join(out)


def _parse(template: str) -> list[Any]:
    """Literal strings, ("path", expr), and ("range", expr, body) nodes."""
    nodes: list[Any] = []
    stack: list[tuple[str, list[Any]]] = []
    pos = 0
    for m in _TOKEN.finditer(template):
        if m.start() > pos:
            nodes.append(template[pos:m.start()])
        expr = m.group(1).strip()
        pos = m.end()
        if expr.startswith("range "):
            stack.append((expr[len("range "):].strip(), nodes))
            nodes = []
        elif expr == "end":
            if not stack:
                raise errors.Invalid("jsonpath: {end} without {range}")
            path, outer = stack.pop()
            outer.append(("range", path, nodes))
            nodes = outer
        elif len(expr) >= 2 and expr[0] == expr[-1] and expr[0] in "'\"":
            nodes.append(expr[1:-1])  # a quoted literal: {"\n"}
        else:
            nodes.append(("path", expr))
    if stack:
        raise errors.Invalid("jsonpath: {range} without {end}")
    if pos < len(template):
        nodes.append(template[pos:])
    for node in nodes:
        if isinstance(node, str) and ("{" in node or "}" in node):
            raise errors.Invalid(f"jsonpath: unclosed action in {template!r}")
    return nodes


def _expand(doc: Any, nodes: list[Any], out: list[str]) -> None:
    for node in nodes:
        if isinstance(node, str):
            out.append(node)
        elif node[0] == "path":
            out.append(" ".join(_text(v) for v in select(doc, node[1])))
        else:
            for item in select(doc, node[1]):
                _expand(item, node[2], out)


def select(doc: Any, expr: str) -> list[Any]:
    """The values `expr` (`.a.b[0].c`, `.items[*].x`, `.items[?(@.a=="b")]`, `$`, `@`) names in
    `doc`; missing: none. Invalid when `expr` is not such a path."""
    expr = expr.strip()
    if expr[:1] in ("$", "@"):  # the root, or in a range the current item: where a path starts anyway
        expr = expr[1:]
    steps = list(_STEP.finditer(expr))
    if "".join(m.group() for m in steps) != expr or (expr and not steps) or ".." in expr:
        raise errors.Invalid(f"jsonpath: cannot read {{{expr}}} (use fields, [n], [*] or [?(@.field==value)])")
    values = [doc]
    for step in steps:
        name, index = step.group(1), step.group(2) or ""
        if name == "":  # `{.}`: the object itself
            continue
        nxt: list[Any] = []
        for v in values:
            if name:
                if isinstance(v, dict) and name in v:
                    nxt.append(v[name])
            elif index == "*":
                nxt.extend(v if isinstance(v, list) else v.values() if isinstance(v, dict) else [])
            elif index.startswith("?"):
                nxt.extend(_filtered(v, index))
            elif isinstance(v, list) and index.lstrip("-").isdigit() and -len(v) <= int(index) < len(v):
                nxt.append(v[int(index)])
            elif isinstance(v, dict) and index.strip("'\"") in v:
                nxt.append(v[index.strip("'\"")])
        values = nxt
    return values


def _filtered(value: Any, test: str) -> list[Any]:
    """The items of `value` (a list, or a mapping's values) that pass `test`, `?(@.path)` or
    `?(@.path OP literal)`: a quoted string, a number, true, false or null."""
    found = _FILTER.fullmatch(test)
    if found is None:
        raise errors.Invalid(f"jsonpath: cannot read the filter [{test}] (use [?(@.field==value)])")
    path, op, literal = found.groups()
    items = value if isinstance(value, list) else list(value.values()) if isinstance(value, dict) else []
    if op is None:
        return [item for item in items if select(item, path)]
    try:
        wanted = json.loads(literal.replace("'", '"') if literal[:1] == "'" else literal)
    except ValueError:
        raise errors.Invalid(f"jsonpath: cannot read {literal!r} in the filter [{test}] "
                             "(a quoted string, a number, true, false or null)") from None

    def passes(got: Any) -> bool:
        try:
            return bool(_COMPARE[op](got, wanted))
        except TypeError:  # ordering a string against a number: no match, as kubectl
            return False
    return [item for item in items if any(passes(got) for got in select(item, path))]


def _text(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"))
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)

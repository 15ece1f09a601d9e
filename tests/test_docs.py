"""The documentation: a README a newcomer reads in minutes, and generated pages kept current."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from tasklease_dev import benchdoc, clidoc, specdoc


def test_the_readme_stays_short() -> None:
    assert len((ROOT / "README.md").read_bytes()) <= 12 * 1024, "README.md over 12 KB: move detail into docs/"


def test_the_benchmarks_page_is_generated_from_the_result_files() -> None:
    assert benchdoc.DOC.read_text() == benchdoc.render(benchdoc.load()), "docs/benchmarks.md is stale: make generate"


def test_without_results_the_page_says_how_to_make_one(tmp_path: Path) -> None:
    text = benchdoc.render(benchdoc.load(tmp_path))
    assert "No results yet" in text and "make bench" in text


def test_a_result_file_is_shown_with_its_machine_commit_date_and_verdicts(tmp_path: Path) -> None:
    old = {"date": "2026-01-01T00:00:00Z", "commit": "aaaaaaaaaaaa", "machine": {"cpu_model": "Old CPU", "nproc": 2},
           "kubernetes": "v1.35.4", "sdk_vs_floor_8": 0.5}
    new = {**old, "date": "2026-02-01T00:00:00Z", "commit": "bbbbbbbbbbbb",
           "machine": {"cpu_model": "New CPU", "nproc": 4}, "sdk_vs_floor_8": 0.9, "writes_per_task_operator": 4.0,
           "cases": {"8": {"raw": {"rate": 100.0}, "sdk": {"rate": 90.0}}}}
    for name, res in (("2026-01-01-aaaaaaaaaaaa.json", old), ("2026-02-01-bbbbbbbbbbbb.json", new)):
        (tmp_path / name).write_text(json.dumps(res))
    text = benchdoc.render(benchdoc.load(tmp_path))
    latest, _, earlier = text.partition("## Earlier results")
    assert "## Latest: 2026-02-01-bbbbbbbbbbbb.json" in latest and "New CPU (4 CPUs)" in latest
    assert "| SDK tasks/s ÷ floor at 8 agents | ≥ 0.8 | 0.900 | met |" in latest
    assert "| writes per task, operator on, happy path | ≤ 3 | 4.000 | **not met** |" in latest
    assert "| 8 | 100.0 | 90.0 | 0.900 |" in latest
    assert "2026-01-01-aaaaaaaaaaaa.json" in earlier and "commit `aaaaaaaaaaaa`, Old CPU" in earlier


@pytest.mark.skipif(sys.version_info >= (3, 13), reason="argparse lays help out otherwise from 3.13; made on 3.11")
def test_the_cli_reference_is_generated_from_the_parser() -> None:
    assert clidoc.DOC.read_text() == clidoc.render(), "docs/cli.md is stale: make generate"
    assert "## tasklease run" in clidoc.DOC.read_text()


def test_the_task_reference_is_generated_from_the_crd() -> None:
    text = specdoc.DOC.read_text()
    assert text == specdoc.render(), "docs/task-reference.md is stale: make generate"
    assert "| `spec.queue` | string (maxLength 63) | (required) |" in text and "`status.history`" in text

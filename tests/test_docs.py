"""The documentation: a README a newcomer reads in minutes, and generated pages kept current."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from tasklease_dev import benchdoc, clidoc, specdoc


def test_the_readme_stays_short() -> None:
    assert len((ROOT / "README.md").read_bytes()) <= 12 * 1024, "README.md over 12 KB: move detail into docs/"


# -- links ---------------------------------------------------------------------------------------

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "helm" / "tasklease" / "README.md"]
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_CODE = re.compile(r"(`+).+?\1", re.S)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """Markdown without its code, where nothing is a link or a heading."""
    return _CODE.sub("", _FENCE.sub("", text))


def anchor(heading: str) -> str:
    """A heading's anchor as GitHub makes it: its text without markup, lower case, punctuation
    dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = text.replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    for heading in _HEADING.findall(_FENCE.sub("", page.read_text())):
        slug, n = anchor(heading), 0
        while (slug if n == 0 else f"{slug}-{n}") in found:  # repeated headings get -1, -2...
            n += 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    found |= set(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", page.read_text()))
    return found


def broken_links(page: Path) -> list[str]:
    """Every relative link of `page` whose file, or anchor in it, does not exist."""
    broken = []
    for target in _LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check offline
            continue
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file):
            broken.append(f"{target}: no heading #{fragment} in {path or page.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_the_link_check_finds_a_missing_file_and_a_missing_anchor(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## The `make bench` run (once)\n\n## Again\n\n## Again\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#the-make-bench-run-once) [again](other.md#again-1) [self](#a-title)\n"
                    "# A title\n[gone](missing.md) [nowhere](other.md#nowhere) [web](https://example.org/x)\n"
                    "`[code](missing-too.md)`\n```\n[fenced](missing-three.md)\n```\n")
    assert broken_links(page) == ["missing.md: no such file",
                                  "other.md#nowhere: no heading #nowhere in other.md"]


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


def test_the_operator_on_cases_cpu_is_shown_by_process_beside_the_floors(tmp_path: Path) -> None:
    def run(sdk_apiserver: float, floor_apiserver: float) -> dict[str, object]:
        return {"sdk": {"rate": 90.0, "cpu_ms_per_task": {"kube-apiserver": sdk_apiserver, "operator": 2.0,
                                                           "workers": 4.0}},
                "raw3": {"rate": 120.0, "cpu_ms_per_task": {"kube-apiserver": floor_apiserver, "workers": 3.0}}}
    res = {"date": "2026-02-01T00:00:00Z", "commit": "bbbbbbbbbbbb", "machine": {"cpu_model": "CPU", "nproc": 2},
           "kubernetes": "v1.35.4", "sdk_operator_on_vs_floor3_16": 0.66,
           "cases": {"operator-on-16": [run(10.0, 7.0), run(14.0, 9.0), run(12.0, 8.0)]}}
    (tmp_path / "2026-02-01-bbbbbbbbbbbb.json").write_text(json.dumps(res))
    text = benchdoc.render(benchdoc.load(tmp_path))
    # The medians of the three pairs: 12 and 8 ms in the API server, 18 and 11 in all.
    assert "| 16 agents | SDK | 12.00 | - | - | 2.00 | 4.00 | 18.00 | 90.0 | 0.61 (tasks/s: 0.660) |" in text
    assert "| 16 agents | 3-write floor | 8.00 | - | - | - | 3.00 | 11.00 | 120.0 |  |" in text
    assert "| 16 over 8 queues |" not in text  # a case not run is not shown
    assert "CPU per task, by process" not in benchdoc.render(benchdoc.load(tmp_path / "none"))


@pytest.mark.skipif(sys.version_info >= (3, 13), reason="argparse lays help out otherwise from 3.13; made on 3.11")
def test_the_cli_reference_is_generated_from_the_parser() -> None:
    assert clidoc.DOC.read_text() == clidoc.render(), "docs/cli.md is stale: make generate"
    assert "## tasklease run" in clidoc.DOC.read_text()


def test_the_task_reference_is_generated_from_the_crd() -> None:
    text = specdoc.DOC.read_text()
    assert text == specdoc.render(), "docs/task-reference.md is stale: make generate"
    assert "| `spec.queue` | string (maxLength 63) | (required) |" in text and "`status.history`" in text

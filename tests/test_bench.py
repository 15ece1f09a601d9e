"""The bench's own arithmetic, verdicts and generated pages, and the chart's defaults beside its figures.

No control plane: the figures come from the checked-in result files.
"""

import json
import re
from pathlib import Path

import pytest
import yaml

from conftest import ROOT
from tasklease_dev import benchdoc
from tasklease_dev.bench.harness import cpu_until, ratio
from tasklease_dev.bench.report import print_report
from tasklease_dev.bench.results import load, newest_with
from tasklease_dev.bench.scale import per_minute
from tasklease_dev.bench.targets import TARGETS, table

# The largest queue the docs promise the chart's defaults hold, and the bench figure measured at it.
DOCUMENTED_MAX_TASKS = 100_000
OPERATOR_RSS_AT_MAX = "operator_rss_mb_100k"
HEADROOM = 1.5


def test_a_workers_cpu_is_read_at_the_cases_end_between_its_marks() -> None:
    # (wall clock, process CPU, main thread CPU, main thread CPU in requests): marked when
    # the clock starts, at each completion, and at the worker's exit after its idle wait.
    marks = [[10.0, 1.0, 0.5, 0.0], [11.0, 2.0, 1.3, 0.6], [13.0, 2.2, 1.4, 0.6]]
    assert cpu_until(marks, 11.0) == pytest.approx((1.0, 0.8, 0.6))  # at a mark: that mark's
    assert cpu_until(marks, 12.0) == pytest.approx((1.1, 0.85, 0.6))  # halfway into the wait
    assert cpu_until(marks, 20.0) == pytest.approx((1.2, 0.9, 0.6))  # past the last mark: the last
    assert cpu_until(marks, 9.0) == pytest.approx((0.0, 0.0, 0.0))  # before the clock started


def test_the_scale_cases_ramp_counts_completions_minute_by_minute() -> None:
    assert per_minute([0.0, 59.9, 60.0, 185.0]) == [2, 1, 0, 1]  # a quiet minute is a 0, not left out
    assert per_minute([]) == []


def test_a_ratio_weighs_both_orders_of_a_pair_alike() -> None:
    # Pairs alternate their order (the case first, then the floor first): each two in turn make
    # one geometric mean, and the figure is their median.
    couples = [(0.6 * 1.2) ** 0.5, (0.7 * 1.1) ** 0.5, (0.65 * 1.0) ** 0.5]
    assert ratio([0.6, 1.2, 0.7, 1.1, 0.65, 1.0]) == pytest.approx(sorted(couples)[1])
    # Five pairs, the case first three times: a plain median of them is 0.7, one of those three.
    # The odd last pair is left out.
    assert ratio([0.6, 1.2, 0.7, 1.1, 0.65]) == pytest.approx((couples[0] + couples[1]) / 2)
    assert ratio([0.9]) == 0.9  # one pair alone is the figure


def test_the_table_names_every_target_and_counts_misses_and_figures_not_run() -> None:
    res = {target.key: target.threshold for target in TARGETS}  # each exactly at its threshold: met
    res["sdk_operator_on_vs_floor3_16"] = 0.5
    del res["agent_first_claim_100k_s"]
    lines, missed = table(res)
    assert len(lines) == len(TARGETS) + 1
    assert missed == ["sdk_operator_on_vs_floor3_16", "agent_first_claim_100k_s"]
    row = next(line for line in lines if line.startswith("SDK ÷ 3-write floor, operator on, 16 agents"))
    assert row.split()[-2:] == ["NOT", "met"] and "≥ 0.8" in row
    assert next(line for line in lines if "first claim" in line).endswith("not run")


def test_the_report_prints_the_throughput_section_of_the_newest_run_that_has_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    # Its rows name the floors that section runs: a floor of another section is not in its cases.
    found = newest_with("sdk_vs_floor_16")
    assert found is not None
    name, res = found
    print_report(res)
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.lstrip().startswith("agents"))
    assert header.split()[1:5] == ["raw", "watched", "protocol", "sdk"], name
    sdk = res["cases"]["16"]["sdk"]["rate"]
    assert any(line.split()[:1] == ["16"] and f"{sdk:.1f}" in line for line in out.splitlines()), name


def test_the_sizing_table_is_generated_from_the_result_files() -> None:
    assert benchdoc.SIZING.read_text() == benchdoc.render_sizing(load()), "docs/sizing-table.md is stale: make generate"


def test_the_sizing_table_shows_the_newest_scale_run(tmp_path: Path) -> None:
    row = {"tasks": 100000, "agents": 16, "operator_rss_mb": 150.4, "operator_cpu_cores": 0.31,
           "agent_rss_mb": 61.0, "agent_cpu_cores": 0.05}
    res = {"date": "2026-02-01T00:00:00Z", "commit": "bbbbbbbbbbbb", "machine": {"cpu_model": "CPU", "nproc": 2},
           "kubernetes": "v1.35.4", "sizing": [row]}
    (tmp_path / "2026-02-01-bbbbbbbbbbbb.json").write_text(json.dumps(res))
    assert "| 100,000 | 150 | 0.31 | 61 | 0.05 |" in benchdoc.render_sizing(load(tmp_path))
    assert "The ramp" not in benchdoc.render_sizing(load(tmp_path))  # a run from before the bench measured it
    res.update(sizes={"scale": 100000}, cases={"scale-100000": {
        "done": 100000, "agent_listed_s": [121.4, 130.0, 140.2, 333.9], "agent_lists_cut_short": 1,
        "done_per_minute": [130, 0, 2900, 3400, 6500]}})
    (tmp_path / "2026-02-01-bbbbbbbbbbbb.json").write_text(json.dumps(res))
    assert ("lists of the queue ended from 121 s to 334 s (median 135 s; 1 cut short and made again in pages); "
            "tasks completed minute by minute: 130, 0, 2,900, 3,400, 6,500.") in benchdoc.render_sizing(load(tmp_path))
    assert "No result file with the scale case" in benchdoc.render_sizing(load(tmp_path / "none"))


def _mebibytes(quantity: str) -> float:
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", quantity).groups()  # type: ignore[union-attr]
    factor = {"Ki": 1 / 1024, "Mi": 1.0, "Gi": 1024.0, "M": 1e6 / 2**20, "G": 1e9 / 2**20, "": 1 / 2**20}[unit]
    return float(number) * factor


def test_the_charts_default_memory_holds_the_documented_maximum_with_headroom() -> None:
    """The operator's default memory limit (and request) against the newest bench figure of
    its peak memory at the documented maximum number of tasks."""
    resources = yaml.safe_load((ROOT / "helm" / "tasklease" / "values.yaml").read_text())["operator"]["resources"]
    measured = newest_with(OPERATOR_RSS_AT_MAX)
    if measured is None:  # a checked-in scale run is what this compares against; none yet
        pytest.skip(f"no result file in bench/results/ has {OPERATOR_RSS_AT_MAX}: "
                    "run make bench BENCH_ARGS='--only scale'")
    name, res = measured
    assert res["sizes"]["scale"] == DOCUMENTED_MAX_TASKS, f"{name} measured a scale other than the documented maximum"
    peak_mib = res[OPERATOR_RSS_AT_MAX]  # VmHWM: KiB / 1024
    limit = _mebibytes(resources["limits"]["memory"])
    assert limit >= HEADROOM * peak_mib, (
        f"helm/tasklease/values.yaml: operator memory limit {resources['limits']['memory']} is below "
        f"{HEADROOM}x the operator's peak {peak_mib:.0f} MiB at {DOCUMENTED_MAX_TASKS:,} tasks ({name})")
    assert _mebibytes(resources["requests"]["memory"]) <= limit


def test_the_documented_maximum_is_the_one_the_bench_measures() -> None:
    sizing = ROOT / "docs" / "sizing.md"
    text = sizing.read_text() if sizing.exists() else benchdoc.SIZING.read_text()
    named = sizing if sizing.exists() else benchdoc.SIZING
    assert f"{DOCUMENTED_MAX_TASKS:,}" in text, f"{named.name} does not name {DOCUMENTED_MAX_TASKS:,} tasks"

"""The targets `make bench` is held to: each figure's JSON key, its threshold, and the verdict table."""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tasklease_dev.bench.recovery import RECLAIM_TARGET_S
from tasklease_dev.bench.space import OBJECTS_FIGURE, SPREADS, operator_on_events, operator_on_figure, spread_words


@dataclass(frozen=True)
class Target:
    figure: str
    key: str
    compare: str  # "≥", "≤", or "-" (shown, not judged)
    threshold: float = 0.0

    @property
    def text(self) -> str:
        return "-" if self.compare == "-" else f"{self.compare} {self.threshold:g}"

    def met(self, value: float) -> bool:
        check: Callable[[float, float], bool] = operator.ge if self.compare == "≥" else operator.le
        return self.compare == "-" or check(value, self.threshold)


TARGETS: list[Target] = [
    *(Target(f"SDK ÷ 3-write floor, operator on, {spread_words(agents, 1)}", operator_on_figure(agents, 1), "≥", 0.8)
      for agents in (16, 8)),
    Target("watch events per task per agent, operator on", operator_on_events(1), "-"),
    *(target for queues in SPREADS for target in (
        Target(f"SDK ÷ 3-write floor, operator on, {spread_words(16, queues)}", operator_on_figure(16, queues), "-"),
        Target(f"watch events per task per agent, {spread_words(16, queues)}", operator_on_events(queues), "-"))),
    # The same three writes with the product's objects (Lease labels, owner and history; the
    # projected status), no watch, no operator: what the objects alone cost against the floor.
    Target("3 writes with the product's objects ÷ 3-write floor, 16 agents", OBJECTS_FIGURE, "-"),
    Target("agent start to first claim, 100k open, 16 agents (s)", "agent_first_claim_100k_s", "≤", 10),
    Target("agent RSS at 100k open (MB)", "agent_rss_mb_100k", "≤", 80),
    Target("operator RSS peak at 100k tasks (MB)", "operator_rss_mb_100k", "≤", 200),
    Target("kill to next claim, same pod name, max (s)", "reclaim_after_kill_same_pod_max_s", "≤", RECLAIM_TARGET_S),
    Target("kill to next claim, new pod name, max (s)", "reclaim_after_kill_new_pod_max_s", "≤", RECLAIM_TARGET_S),
    Target("drain of 100k ÷ of 500, operator on", "drain_100k_vs_500", "≥", 0.8),
    Target("`tasklease claim` p50 ÷ GET+PUT, 10k open", "cli_claim_vs_floor_10k", "≤", 3),
    Target("SDK tasks/s ÷ floor at 8 agents", "sdk_vs_floor_8", "≥", 0.8),
    Target("SDK tasks/s ÷ floor at 16 agents", "sdk_vs_floor_16", "≥", 0.8),
    Target("409s per task at 16 agents", "conflicts_per_task_16", "≤", 0.05),
    Target("drain rate at 30k open ÷ at 500", "drain_30k_vs_500", "≥", 0.8),
    Target("wake-ups per renewal, idle agent", "renewal_wakeups_per_idle_agent", "≤", 0.01),
    Target("writes per task, operator on, happy path", "writes_per_task_operator", "≤", 3),
    Target("status projection lag p99 at 100 tasks/s (s)", "projection_lag_p99_s", "≤", 2),
    Target("operator RSS at 10k tasks (MB)", "operator_rss_mb_10k", "≤", 100),
    Target("claim p50 ÷ one conditional PUT (warm, interleaved)", "claim_vs_put", "≤", 1.1),
    Target("claim p50 ÷ client-go acquire", "claim_vs_client_go", "-"),
    Target("claim p50 ÷ Python LeaderElection acquire", "claim_vs_python_le", "-"),
    Target("requeue after SIGKILL, max (s, lease 5 s)", "requeue_after_kill_max_s", "≤", 6),
    Target("requeue after holder Pod deleted, max (s)", "requeue_after_pod_delete_max_s", "≤", 1),
]


def verdict(target: Target, value: Any) -> str:
    """"met", "NOT met", "" (shown only), or "not run"."""
    if value is None:
        return "not run"
    return "" if target.compare == "-" else ("met" if target.met(value) else "NOT met")


def shown(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if abs(value) < 10 else f"{value:.0f}"


def table(res: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The verdict table's lines, and the keys of the targets missed or not run."""
    lines = [f"{'figure':54} {'target':>8} {'measured':>10}  verdict"]
    missed = []
    for target in TARGETS:
        value = res.get(target.key)
        said = verdict(target, value)
        if said in ("NOT met", "not run"):
            missed.append(target.key)
        lines.append(f"{target.figure:54} {target.text:>8} {shown(value):>10}  {said}")
    return lines, missed

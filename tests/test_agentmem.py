"""The agent memory probe (`python -m tasklease_dev.agentmem`) feeds a QueueView what a list brings."""

from __future__ import annotations

import pytest

from tasklease_dev import agentmem

pytestmark = pytest.mark.unit


def test_the_probe_lists_every_task_through_the_watch_and_each_is_a_candidate() -> None:
    got = agentmem._fill(1_234, top=0)  # two full pages and a part of one
    assert got["tasks"] == got["claimable"] == got["relisted"] == 1_234
    assert got["relist_hwm_mb"] >= got["hwm_mb"] >= got["rss_after_mb"] > 0

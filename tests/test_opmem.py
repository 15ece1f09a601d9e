"""The operator memory probe (`python -m tasklease_dev.opmem`) takes every task through the scale case's lifecycle."""

from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client")  # the operator's extra: not on the SDK-only Pythons of `make unit-all`

from tasklease_dev import opmem  # noqa: E402

pytestmark = pytest.mark.unit


def test_the_probe_takes_every_task_to_succeeded_through_the_operators_watches() -> None:
    got = opmem._fill(150, top=0)
    assert got["tasks"] == got["succeeded"] == 150 and got["hwm_mb"] >= got["rss_after_mb"] > 0


def test_open_tasks_stay_pending() -> None:
    got = opmem._fill(40, top=0, claimed=False)
    assert (got["pending"], got["succeeded"]) == (40, 0)

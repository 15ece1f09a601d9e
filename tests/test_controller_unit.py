"""The operator's kopf wiring without a control plane: what asyncio reports on kopf's loop."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest

from tasklease.operator.controller import report_briefly

pytestmark = pytest.mark.unit


def test_what_asyncio_reports_on_kopfs_loop_is_one_line_and_its_traceback_is_kept_at_debug(
        caplog: pytest.LogCaptureFixture) -> None:
    # What kopf's discovery leaves when it is cancelled at shutdown: a request that ends in the
    # closed session, whose exception nobody retrieves.
    async def request() -> None:
        raise ConnectionError("Connection closed")

    loop = asyncio.new_event_loop()
    loop.set_exception_handler(report_briefly)
    caplog.set_level(logging.DEBUG)
    try:
        task = loop.create_task(request())
        loop.run_until_complete(asyncio.wait([task]))
        del task
        gc.collect()  # asyncio reports an unretrieved exception when the task is collected
    finally:
        loop.close()
    ours = [r for r in caplog.records if r.name == "tasklease.operator"]
    assert [(r.levelno, r.getMessage()) for r in ours] == [
        (logging.WARNING, "kopf's event loop: Task exception was never retrieved "
                          "(ConnectionError('Connection closed'))"),
        (logging.DEBUG, "the traceback of what kopf's event loop reported")]
    assert ours[0].exc_info is None and ours[1].exc_info is not None
    assert [r for r in caplog.records if r.name == "asyncio"] == []

"""The bench's own arithmetic: pure, no control plane."""

import pytest

from tasklease_dev.bench import cpu_until


def test_a_workers_cpu_is_read_at_the_cases_end_between_its_marks() -> None:
    # (wall clock, process CPU, main thread CPU, main thread CPU in requests): marked when
    # the clock starts, at each completion, and at the worker's exit after its idle wait.
    marks = [[10.0, 1.0, 0.5, 0.0], [11.0, 2.0, 1.3, 0.6], [13.0, 2.2, 1.4, 0.6]]
    assert cpu_until(marks, 11.0) == pytest.approx((1.0, 0.8, 0.6))  # at a mark: that mark's
    assert cpu_until(marks, 12.0) == pytest.approx((1.1, 0.85, 0.6))  # halfway into the wait
    assert cpu_until(marks, 20.0) == pytest.approx((1.2, 0.9, 0.6))  # past the last mark: the last
    assert cpu_until(marks, 9.0) == pytest.approx((0.0, 0.0, 0.0))  # before the clock started

"""The speculation plan on synthetic step times: drafts are verified where expected accepted
tokens outweigh the longer step, and not where the step grows faster than its output."""
from __future__ import annotations

import pytest

from engine_worker.engine.spec_policy import StepTimes, grid_point, plan_drafts


def memory_bound(n: int) -> float:
    """A CPU decode step reading the weights once: 20 ms, plus 0.1 ms a token scored."""
    return 0.020 + 0.0001 * n


def compute_bound(n: int) -> float:
    """A step whose time grows with every token (a large batch on a saturated GEMM)."""
    return 0.001 * n


def test_a_single_decode_verifies_all_its_likely_drafts_on_a_memory_bound_step():
    assert plan_drafts([0.8], [5], num_decodes=1, num_tokens=1, step_time=memory_bound) == [5]


def test_unlikely_drafts_are_not_verified():
    assert plan_drafts([0.0], [5], num_decodes=1, num_tokens=1, step_time=memory_bound) == [0]
    # a draft accepted 2% of the time saves less than its 0.1 ms of a 20 ms step
    assert plan_drafts([0.002], [5], num_decodes=1, num_tokens=1, step_time=memory_bound) == [0]


def test_a_compute_bound_step_verifies_nothing():
    rates = [0.7] * 32
    assert plan_drafts(rates, [5] * 32, num_decodes=32, num_tokens=32, step_time=compute_bound) == [0] * 32


def test_a_large_batch_keeps_only_the_drafts_that_pay():
    """Step time flat to 64 tokens, then steep: the most likely sequences' first drafts fill the
    flat part, the rest are dropped."""
    def knee(n: int) -> float:
        return 0.030 if n <= 64 else 0.030 + 0.002 * (n - 64)
    rates = [0.9] * 16 + [0.3] * 16
    counts = plan_drafts(rates, [5] * 32, num_decodes=32, num_tokens=32, step_time=knee)
    assert sum(counts) == 32
    assert counts[:16] == [2] * 16 and counts[16:] == [0] * 16


def test_longer_drafts_go_to_the_sequences_that_accept_more():
    counts = plan_drafts([0.95, 0.5], [5, 5], num_decodes=2, num_tokens=2,
                         step_time=lambda n: 0.010 + 0.001 * n)
    assert counts[0] == 5 and 0 < counts[1] < 5


def test_step_times_interpolate_between_measured_points_and_stay_flat_beyond():
    times = StepTimes()
    assert times.predict(7) == 1.0                       # nothing measured: every size looks alike
    for _ in range(3):
        times.observe(8, 0.010)
        times.observe(64, 0.024)
    assert times.predict(8) == pytest.approx(0.010)
    assert times.predict(36) == pytest.approx(0.017)
    assert times.predict(2) == times.predict(8) and times.predict(500) == times.predict(64)


def test_step_times_average_the_latest_steps_on_a_geometric_grid():
    assert [grid_point(n) for n in (1, 2, 3, 8, 9, 10, 100, 128)] == [1, 2, 3, 8, 10, 10, 108, 128]
    times = StepTimes(weight=0.5)
    times.observe(9, 0.010)
    times.observe(10, 0.020)         # the same grid point: the average moves halfway
    assert times.points == [10] and times.predict(10) == pytest.approx(0.015)

"""headwise.tune: the measurement of the unit costs itself (real timings, so nothing here
asserts a speed: only that every cost comes out positive and finite, that the caller's
state is untouched, and that a fit too noisy to keep is refused)."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from headwise import calibration, tune

QUICK = tune.Timing(repeats=1, loop_s=1e-4)


def test_a_forward_measurement_gives_positive_finite_costs():
    try:
        costs = tune.measure_costs(False, QUICK)
    except calibration.MeasurementError as e:  # a busy machine may scatter even this
        pytest.skip(f"the machine was too busy to fit: {e}")
    for name, value in costs.__dict__.items():
        assert math.isfinite(value) and value >= 0, name
    assert costs.call_us > 0 and costs.gemm_ps > 0 and costs.attn_ps > 0


def test_the_measurement_leaves_the_callers_state_as_it_was():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        with contextlib.suppress(calibration.MeasurementError):
            tune.measure_costs(True, QUICK)
        assert torch.is_inference_mode_enabled() and torch.is_autocast_enabled("cpu")
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("points, message", [
    ([(1.0, 3.0), (2.0, 2.0), (3.0, 1.0)], "slope -1e"),
    ([(1.0, 1.0), (2.0, 9.0), (3.0, 1.0), (4.0, 9.0)], "R\\^2 0.20"),
])
def test_a_fit_that_does_not_hold_is_refused(points, message):
    with pytest.raises(calibration.MeasurementError, match=f"gemm_ps: .*{message}.*`headwise tune` measures again"):
        tune._slope(points, "gemm_ps")


def test_a_clean_fit_gives_its_slope_in_picoseconds():
    assert tune._slope([(1.0, 2e-12), (2.0, 4e-12), (3.0, 6e-12)], "x") == pytest.approx(2.0)

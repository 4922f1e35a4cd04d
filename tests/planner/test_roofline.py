"""Roofline profiles (planner/roofline.py): estimates that follow the roofline's two
limits, in the profile format the simulator and the planner read."""

from __future__ import annotations

import pytest

from pdserve.planner.roofline import GPUS, MODELS, roofline_profile
from pdserve.planner.simulator import Limits, Shape, Simulation, Traffic, figures


def test_decode_is_bandwidth_bound_and_prefill_compute_bound():
    model, gpu = MODELS["llama-3-8b"], GPUS["H100"]
    p = roofline_profile(model, gpu, overhead=0.0)
    weights = model.params * 2
    assert p.decode_seconds(1, 256) == pytest.approx((weights + 2 * 32 * 8 * 128 * 2 * 256) / (gpu.bandwidth * 0.7))
    assert p.prefill_seconds(4096, 0) > 2 * model.params * 4096 / (gpu.flops * 0.5)
    assert p.prefill_seconds(4096, 0) / p.prefill_seconds(1024, 0) > 3.5  # compute-bound: ~linear in tokens
    assert p.decode_seconds(32, 256) / p.decode_seconds(1, 256) < 1.2  # memory-bound: weights read once
    assert roofline_profile(model, GPUS["H200"], overhead=0.0).decode_seconds(1, 256) < p.decode_seconds(1, 256)
    assert roofline_profile(model, gpu, tp=2).source["num_blocks"] > 2 * p.source["num_blocks"]


def test_a_model_that_does_not_fit_is_refused_and_a_plan_runs_on_an_estimate():
    with pytest.raises(ValueError, match="does not fit"):
        roofline_profile(MODELS["llama-3-70b"], GPUS["H100"], tp=1)
    p = roofline_profile(MODELS["llama-3-8b"], GPUS["H100"])
    outcomes = Simulation(p, Shape(prefill=1, decode=1, mixed=0), Limits(8192, 512, p.source["num_blocks"], 16)).run(
        Traffic(5, 50, (1024, 2048), (64, 128)).draw())
    assert all(o.done for o in outcomes) and figures(outcomes).ttft_p50 < 1.0

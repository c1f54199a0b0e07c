"""fp16 with dynamic loss scaling: tracks the fp32 reference; an overflow on one rank skips the step everywhere and
moves the scale by DeepSpeed's hysteresis rules."""

from __future__ import annotations

import math

import pytest

from hybridzero.optim.loss_scaler import ScalerConfig, initial_state, update_scale
from tests.harness.parity import RunSpec, engine_run, reference_run, step_losses

FP16 = {"initial_scale_power": 8, "hysteresis": 2, "loss_scale_window": 2}


@pytest.mark.parametrize("world_size", [2, 3])
def test_fp16_tracks_fp32_reference(world, world_size: int) -> None:
    """Stated tolerance: losses within 2% and parameters within 5e-3 of the fp32 reference after 4 steps."""
    spec = RunSpec(model="llama", steps=4, dtype="fp16", lr=1e-3, accumulation=2, clipping=1.0, fp16=FP16)
    results = world(world_size).run(engine_run, spec)
    ref = reference_run(spec.replace(dtype="fp32"), world_size)
    assert all(applied for _, applied in results[0]["scales"])
    for a, b in zip(step_losses(results), ref["losses"]):
        assert abs(a - b) <= 0.02 * abs(b)
    for name, value in ref["params"].items():
        assert (results[0]["params"][name] - value).abs().max().item() <= 5e-3, name


def test_overflow_on_one_rank_skips_everywhere_with_hysteresis(world) -> None:
    spec = RunSpec(model="gpt2_tied", steps=6, dtype="fp16", lr=1e-3, fp16=FP16, inf_at=((1, 1), (2, 0)))
    results = world(2).run(engine_run, spec)
    assert results[0]["scales"] == results[1]["scales"], "every rank must agree on scale and skip"
    cfg = ScalerConfig.from_fp16(True, 0.0, 8, 2, 2, False, 1.0)
    state, expected = initial_state(cfg), []
    for s in range(spec.steps):
        overflow = s in (1, 2)
        state = update_scale(state, overflow, cfg)
        expected.append((state.scale, not overflow))
    assert results[0]["scales"] == expected
    assert expected[1][0] == 256.0 and expected[2][0] == 128.0  # hysteresis 2: first overflow keeps, second halves
    ref = reference_run(spec.replace(dtype="fp32"), 2)  # skips the same two steps
    for s, (a, b) in enumerate(zip(step_losses(results), ref["losses"])):
        if s not in (1, 2):
            assert abs(a - b) <= 0.02 * abs(b), s
        else:
            assert not math.isfinite(a)
    for name, value in ref["params"].items():
        assert (results[0]["params"][name] - value).abs().max().item() <= 5e-3, name

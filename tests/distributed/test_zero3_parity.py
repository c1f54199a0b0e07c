"""ZeRO-3 against a single-process reference: every step's loss and the final parameters (fp32).

Tolerance: the sharded gradient is the same sum as the reference's in another order, so results agree to float
rounding: losses within 1e-6 relative; parameters within 1e-6 (rtol=atol=1e-6).
"""
from __future__ import annotations

import pytest
import torch

from hybridzero.testing.parity import RunSpec, engine_run, reference_run, step_losses

MODELS = ["llama", "opt", "opt_postln", "gpt2_tied", "gpt2_untied"]


def check_against_reference(results: list[dict], spec: RunSpec, world: int, rtol: float = 1e-6) -> None:
    ref = reference_run(spec, world)
    got = step_losses(results)
    for s, (a, b) in enumerate(zip(got, ref["losses"])):
        assert abs(a - b) <= rtol * abs(b), f"step {s}: engine loss {a} vs reference {b}"
    params = results[0]["params"]
    assert set(params) == set(ref["params"])
    for name, value in ref["params"].items():
        torch.testing.assert_close(params[name], value, rtol=rtol, atol=rtol, msg=lambda m: f"{name}: {m}")
    assert results[0]["lr"] == pytest.approx(ref["lr"], rel=1e-12)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("model", MODELS)
def test_parity_models(world, world_size: int, model: str) -> None:
    spec = RunSpec(model=model, steps=3)
    results = world(world_size).run(engine_run, spec)
    check_against_reference(results, spec, world_size)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("case", ["accum3_clip_client", "accum3_config_sched", "clip_scalar_sgd"])
def test_parity_accumulation_clipping_optimizers(world, world_size: int, case: str) -> None:
    spec = {
        "accum3_clip_client": RunSpec(model="llama", accumulation=3, clipping=0.5, optimizer="client"),
        "accum3_config_sched": RunSpec(model="gpt2_tied", accumulation=3, scheduler=True, steps=4),
        "clip_scalar_sgd": RunSpec(model="opt", clipping=0.05, with_scalar=True, optimizer_type="SGD", lr=0.1),
    }[case]
    results = world(world_size).run(engine_run, spec)
    check_against_reference(results, spec, world_size)

"""ZeRO stages 0, 1 and 2 through the same machinery: the stage-3 parity suite, the ledger and the optimizer-state
split."""

from __future__ import annotations

import pytest

from hybridzero.zero.layout import ALIGN
from tests.distributed.test_zero3_parity import compare
from tests.harness.parity import RunSpec, build_model, engine_run, reference_run


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_stage_parity(world, world_size: int, stage: int) -> None:
    for spec in (
        RunSpec(model="llama", stage=stage, steps=3),
        RunSpec(
            model="gpt2_tied",
            stage=stage,
            accumulation=3,
            clipping=0.5,
            optimizer="client",
            with_scalar=True,
            frozen=("wpe",),
        ),
    ):
        compare(world(world_size).run(engine_run, spec), reference_run(spec, world_size))


@pytest.mark.parametrize("world_size", [2, 3])
def test_stage_ledgers_and_optimizer_state(world, world_size: int) -> None:
    pool = world(world_size)
    runs = {stage: pool.run(engine_run, RunSpec(model="opt", stage=stage, steps=2)) for stage in (0, 1, 2, 3)}
    for stage, results in runs.items():
        phases = {(row["collective"], row["phase"]) for r in results for row in r["ledger"]}
        gathers_in_forward = ("all_gather", "forward") in phases
        assert gathers_in_forward == (stage == 3), f"stage {stage} forward gathers: {gathers_in_forward}"
    params = [p for p in build_model(RunSpec(model="opt")).parameters() if p.requires_grad]
    trainable, gaps = sum(p.numel() for p in params), ALIGN * len(params)  # alignment gaps: < ALIGN per parameter
    whole = runs[0][0]["exp_avg_numel"]
    assert all(r["exp_avg_numel"] == whole for r in runs[0]) and trainable <= whole <= trainable + gaps
    for stage in (1, 2, 3):
        per_rank = [r["exp_avg_numel"] for r in runs[stage]]
        assert sum(per_rank) == whole and max(per_rank) <= whole / world_size + ALIGN, (stage, per_rank)

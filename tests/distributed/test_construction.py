"""Sharded construction and memory: HF checkpoints load straight into shards; a model built on the meta device
is materialized one group at a time and never whole on a rank; the memory report matches 16Ψ/N (bf16 + Adam)
and a process-level measurement of live tensor storage."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness.parity import RunSpec, build_model
from tests.workers.construction import (
    engine_over_a_submodule_of_a_held_model,
    logits_from_pretrained,
    second_engine_over_a_held_model,
    train_meta_model,
)


@pytest.mark.parametrize("model", ["llama", "gpt2_tied", "opt"])
@pytest.mark.parametrize("stage", [3, 2])
def test_from_pretrained_into_shards_gives_same_logits(world, tmp_path: Path, model: str, stage: int) -> None:
    build_model(RunSpec(model=model)).save_pretrained(tmp_path, max_shard_size="20KB")  # sharded, with an index
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert world(3).run(logits_from_pretrained, str(tmp_path), model, stage) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(("stage", "second_stage"), [(3, None), (2, None), (1, None), (3, 2)])
def test_second_engine_over_a_model_a_live_engine_holds(world, stage: int, second_stage: int | None) -> None:
    """``initialize`` over a model an earlier engine still holds starts from that engine's trained values, bit for bit
    (at ZeRO-3 gathered from it group by group), trains, and owns the parameters after; also from ZeRO-3 into a
    stage-2 engine that groups the parameters differently (attention frozen)."""
    got = world(3).run(second_engine_over_a_held_model, stage, second_stage)
    assert got == [{"mismatched": [], "trains": True, "owner_is_second": True}] * 3


def test_engine_over_a_submodule_of_a_held_model_is_refused(world) -> None:
    """Taking a shared submodule over would break the engine that drives the whole model: refused on every rank."""
    pool = world(2, env={"HYBRIDZERO_TEST": "failure"})  # the refusal tears the process group down: its own pool
    got = pool.run(engine_over_a_submodule_of_a_held_model)
    assert all("ValueError" in g and "shared submodule" in g and "destroy()" in g for g in got), got


@pytest.mark.slow
def test_meta_model_is_never_whole_on_a_rank(world) -> None:
    """Per-rank budget 0.85 × the model's fp32 bytes: construction (process RSS growth) and training (largest
    set of simultaneously gathered parameters, bounded by ``stage3_max_live_parameters`` = 0.3 of the model, which
    limits how much a forward keeps gathered for its backward) stay inside it, while training still works."""
    results = world(4, env={"HYBRIDZERO_TEST": "construction"}).run(train_meta_model, 12, "fp32", 0.3, timeout=400)
    model_bytes = 4 * results[0]["numel"]
    budget = 0.85 * model_bytes
    for r in results:
        assert r["rss_init_growth"] < budget, (r["rss_init_growth"], model_bytes)
        assert r["peak_gathered"] < budget
        assert all(loss == loss and loss < 10 for loss in r["losses"])
        assert r["report"]["gathered"] == 0


@pytest.mark.parametrize("world_size", [2, 4])
def test_memory_report_16_psi_over_n_and_process_measurement(world, world_size: int) -> None:
    results = world(world_size).run(train_meta_model, 2, "bf16", timeout=300)
    for r in results:
        psi, rep = r["numel"], r["report"]
        bound = 1.05 * 16 * psi / world_size + 16 * rep["persisted_numel"]
        assert rep["model_states"] <= bound, (rep, bound)
        assert rep["gathered"] == 0
        # independent check: growth of all live tensor storage in the process ≈ the report (buffers are tiny)
        assert rep["model_states"] <= r["live_growth"] <= rep["model_states"] * 1.01 + 65536, (r["live_growth"], rep)

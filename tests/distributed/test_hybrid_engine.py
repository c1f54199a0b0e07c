"""Hybrid engine: generation on parameters gathered once, at every world size, for every architecture.

Greedy tokens equal the unsharded model's (also with rank-dependent batch sizes, prompt lengths and early EOS);
generation-mode logits equal the ZeRO-3 forward's within 1e-6; no collective while decoding; memory restored;
an exception inside generation reaches the caller unchanged and leaves the engine sharded and quiescent; train →
generate cycles end bitwise equal to the same run without generation."""

from __future__ import annotations

import pytest
import torch

from tests.harness.parity import RunSpec
from tests.workers.hybrid import hybrid_checks, train_generate_cycles

MODELS = ["opt", "opt_postln", "llama", "gpt2_tied", "llama_scalar"]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("model", MODELS)
def test_generation_matches_unsharded(world, world_size: int, model: str) -> None:
    results = world(world_size).run(hybrid_checks, model, timeout=240)
    for rank, r in enumerate(results):
        assert r["mode"] == "full"
        assert r["tokens_equal"], (rank, r)
        assert r["early_stop"] == (rank % 2 == 1)
        assert r["decode_collectives"] == 0
        assert r["logits_gen_vs_zero3"] <= 1e-6 and r["logits_gen_vs_ref"] <= 1e-6, r
        assert r["memory_restored"]
        assert r["raised"] == "boom at decode step 3"
        assert "hybrid_engine.max_out_tokens=512" in r["too_long"]
        assert "hybrid_engine.max_out_tokens=512" in r["too_long_bucketed"] and r["alive_after"], r


@pytest.mark.parametrize("world_size", [2, 3])
def test_train_generate_cycles_bitwise_and_bucketed_mode(world, world_size: int) -> None:
    spec = RunSpec(model="llama", steps=5, accumulation=1, prefetch_bucket_size=10**9)
    pool = world(world_size)
    plain = pool.run(train_generate_cycles, spec, False)
    hybrid = pool.run(train_generate_cycles, spec, True)
    bucketed = pool.run(train_generate_cycles, spec, True, 1000)  # budget too small: bucketed path
    for run in (hybrid, bucketed):
        for name, value in plain[0]["params"].items():
            assert torch.equal(run[0]["params"][name], value), name
        assert all(all(r["reports"]) and len(r["reports"]) == 5 for r in run)
    assert hybrid[0]["modes"] == ["full"] * 5 and bucketed[0]["modes"] == ["bucketed"] * 5
    groups = hybrid[0]["groups"]
    assert hybrid[0]["gathers"] == [groups] * 5  # one gather per group, then nothing while decoding
    # bucketed: every gather counted, 4 forwards x the whole model; per forward the root group (needed first) and
    # the blocks the trace prefetches go out as one coalesced collective
    assert bucketed[0]["gathered_bytes"] == [4 * bucketed[0]["model_bytes"]] * 5
    assert bucketed[0]["gathers"] == [4 * 1] * 5 and groups == 3

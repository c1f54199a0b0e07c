"""Packed rows under Ulysses sequence parallelism: packed at s = 2 equals unpacked and packed at s = 1.

World 2 (s = 2, dp 1) and world 4 (s = 2, dp 2), fp32, stage 3, the tiny GQA Llama of
:mod:`tests.workers.sequence_parallel` (vocabulary 113, intermediate 67, hidden 28: numels not divisible by 3 or 4,
shards padded) with eager attention and split kv heads, and SDPA with a repeated kv head. Each group's six SFT
examples are packed into rows of 13 slots whose sequences cross the slice boundary (:mod:`tests.workers.sp_packing`);
one packed forward, and the token budget's chunks (``--max_tokens_per_batch 13``: one packed row per chunk, each
split over the group, backwarded in one group).

Tolerances, as in ``tests/distributed/test_sequence_parallel.py``: the exchanges move values and the per-head
kernels compute each head alone, so only the order of summation differs; the block-causal mask adds exact zeros or
excludes the same keys as the unpacked causal mask over one sequence. Loss: a reorder of at most n = 42 fp32 slot
terms (the sum per slice, then over ranks, or per chunk): |Δ| <= (n - 1) u Σ|terms| ~ 2.5e-6 · loss; 1e-5 relative.
Gradients: 2e-5 of each tensor's largest entry (each entry a sum over <= 42 token contributions reordered at each of
the ~10 summations of the backward chain, each bounded by n u = 2.5e-6).
"""

from __future__ import annotations

import pytest

from tests.workers.sequence_parallel import CASES, LAYERS
from tests.workers.sp_packing import reference, sp_packed_gradients


@pytest.mark.parametrize("world_size", [2, 4])
def test_packed_rows_at_sp2_equal_unpacked_and_packed_s1(world, world_size: int) -> None:
    results = world(world_size).run(sp_packed_gradients, 2, timeout=420)
    ref = reference(world_size // 2)
    for impl, kv in CASES:
        for mode in ("packed", "budget"):
            case = f"{impl}/{kv}/{mode}"
            for want_key in ("unpacked", "packed"):
                want = ref[f"{impl}/{kv}/{want_key}"]
                for rank, res in enumerate(results):
                    got, expected = res[case]["loss"], want["losses"][rank // 2]
                    assert abs(got - expected) <= 1e-5 * abs(expected), (case, want_key, rank, got, expected)
                    if mode == "packed":
                        assert res[case]["a2a"] == 4 * LAYERS, (case, rank)  # 2 per layer each way
                grads = results[0][case]["grads"]
                assert grads.keys() == want["grads"].keys()
                for name, g in want["grads"].items():
                    scale = float(g.abs().max())
                    assert scale > 0, name
                    assert float((grads[name] - g).abs().max()) <= 2e-5 * scale, (case, want_key, name)


def test_sft_step_with_sequence_parallel_equals_s1(world, tmp_path) -> None:
    """``sft --sequence_parallel_size 2`` (packed, padded, and packed under ``--max_tokens_per_batch 24``: training
    and evaluation in chunks) at world 2 trains on the global batches of the s = 1
    run at world 1 (the two ranks of the SP group share each micro-batch) and reports its losses: two AdamW steps of
    the demo Llama (fp32, eager), tolerance 2e-5 as ``tests/distributed/test_packing.py``'s end-to-end run (the
    forwards differ by summation order only)."""
    from tests.workers.rlhf_runs import sft_run

    base = {"per_device_train_batch_size": 4, "max_seq_len": 24, "max_steps": 2, "progress": False}
    base.update(eval_fraction=0.02, print_every=1000, enable_tensorboard=False, learning_rate=3e-3)
    ref = world(1).run(sft_run, {**base, "output_dir": str(tmp_path / "ref")})[0]
    for packed, budget in ((True, None), (False, None), (True, 24)):
        run = {**base, "output_dir": str(tmp_path / f"sp{packed}{budget}"), "packing_samples": packed}
        run.update(sequence_parallel_size=2, max_tokens_per_batch=budget)
        for got in world(2).run(sft_run, run, timeout=420):
            for key in ("loss", "eval_loss"):
                assert abs(got[key] - ref[key]) <= 2e-5 * abs(ref[key]), (packed, budget, key, got[key], ref[key])

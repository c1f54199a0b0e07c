"""Ulysses sequence parallelism (``sequence_parallel_size`` = s = 2) at world 2 (dp 1) and world 4 (dp 2).

Against the ``s = 1`` math in one process at the same global batch (each data-parallel group's batch, its HF loss,
the mean of their gradients), for a GQA Llama whose 2 kv heads split over the ranks (eager attention) and one whose
single kv head is repeated (SDPA), with sequences of 13 tokens (the last slice right-padded):

* the loss on every rank of an SP group equals that group's ``s = 1`` loss. The all-to-alls only move values, and
  eager / SDPA attention on CPU compute each head independently, so the forward is the same arithmetic; what differs
  is the order of summation: the loss is (sum over slice 0 + sum over slice 1) / count instead of one sum, a reorder
  of at most n = 26 fp32 terms: |Δ| <= (n - 1) u Σ|terms| ~ 25 · 6e-8 · loss, so 1e-5 relative holds with margin;
* every gradient equals the reference to 2e-5 of the tensor's largest entry: each entry is a sum over n <= 26 token
  contributions, reordered (per slice, then across ranks in the reduce-scatter) at each of the ~10 summations along
  the backward chain of 2 blocks (attention, MLP, two norms, the head), each reorder bounded by n u = 1.6e-6;
* the ledger holds exactly 2 all-to-alls per layer in forward and 2 in backward, with the bytes of the packed q|k|v
  and of the output, and one all-reduce of (sum, count) each way;
* the model's own attention implementation is back after ``engine.destroy()``.
"""

from __future__ import annotations

import pytest

from tests.workers.sequence_parallel import (
    CASES,
    LAYERS,
    MICRO,
    SEQ,
    reference_generation,
    reference_gradients,
    sp_errors,
    sp_generate,
    sp_gradients,
)


def _a2a_bytes(kv: int, s: int = 2, heads: int = 4, head_dim: int = 6) -> int:
    """Per forward: per layer the packed q|k|v (kv heads repeated to the query heads when s does not divide them)
    and the output, each the local slice's fp32 bytes (whole buffer, as the ledger counts)."""
    local = -(-SEQ // s)
    kv_sent = kv if kv % s == 0 else heads
    per_position = MICRO * head_dim * 4
    return LAYERS * (heads + 2 * kv_sent + heads) * local * per_position


@pytest.mark.parametrize("world_size", [2, 4])
def test_sp2_loss_and_gradients_equal_s1(world, world_size: int) -> None:
    results = world(world_size).run(sp_gradients, 2, timeout=420)
    ref = reference_gradients(world_size // 2)
    for impl, kv in CASES:
        case = f"{impl}/{kv}"
        for rank, res in enumerate(results):
            r = res[case]
            expected = ref[case]["losses"][rank // 2]
            assert abs(r["loss"] - expected) <= 1e-5 * abs(expected), (case, rank, r["loss"], expected)
            assert r["a2a"] == (2 * LAYERS, 2 * LAYERS), (case, rank)
            assert r["a2a_bytes"] == _a2a_bytes(kv), (case, rank)
            assert r["loss_reduces"] == (1, 1), (case, rank)
            assert r["impl_during"].startswith("hybridzero_ulysses_") and r["impl_after"] == impl, (case, r)
            assert r["local_len"] == 7
        grads = results[0][case]["grads"]
        assert grads.keys() == ref[case]["grads"].keys()
        for name, want in ref[case]["grads"].items():
            scale = float(want.abs().max())
            assert scale > 0, name
            assert float((grads[name] - want).abs().max()) <= 2e-5 * scale, (case, name)


def test_sp_errors_name_value_and_fix(world) -> None:
    for got in world(2).run(sp_errors, timeout=300):
        assert got["world"] == (
            "sequence_parallel_size = 3 does not divide world_size = 2 (groups of 3 consecutive ranks share each "
            "sequence); valid values: 1, 2"
        ), got
        assert got["heads"].startswith("sequence_parallel_size = 2 must divide num_attention_heads = 5"), got
        assert "valid sizes: 1, 5" in got["heads"]
        assert got["impl"].startswith("attn_implementation = 'flex_attention' cannot be split by "), got
        assert "'sdpa', 'eager'" in got["impl"]
        assert got["short"].startswith("sequence length 1 is shorter than sequence_parallel_size = 2"), got
        assert "pad on the right" in got["left_pad"], got


def test_generate_under_sp_equals_s1(world) -> None:
    """``engine.generate`` at s = 2 (world 2): each rank generates for its own prompts with the model's own attention
    on the gathered weights (a one-token decode step cannot be split), full and bucketed; the greedy tokens equal the
    plain model's (s = 1, no engine: the same weights and arithmetic, so exactly equal). The Ulysses attention is off
    inside ``generation_mode`` and back after, and a training forward after generation runs SP (its all-to-alls)."""
    for rank, got in enumerate(world(2).run(sp_generate, 2, timeout=300)):
        want = reference_generation(rank)
        for impl, kv in CASES:
            case, res = f"{impl}/{kv}", got[f"{impl}/{kv}"]
            assert res["tokens"] == want[case] and res["bucketed"] == want[case], (case, rank, res, want[case])
            assert res["during"] == impl and res["after"].startswith("hybridzero_ulysses_"), (case, res)
            assert res["a2a"] == 4 * LAYERS, (case, rank)


def _example_run(seq_len: int, budget_mib: float) -> dict[str, object]:
    """examples/long_sequence_sp.py's training on this worker's world (3 SGD steps, memory measured)."""
    from long_sequence_sp import train

    try:
        return train(seq_len, 3, budget_mib, measure=True)
    except ValueError as exc:
        return {"error": str(exc)}


def test_long_sequence_example_trains_at_s2_with_the_s1_loss(world) -> None:
    """A sequence whose planned activations exceed the budget at s = 1 (the run refuses) fits at s = 2 and trains
    with the losses of the s = 1 run without a budget (1e-5 relative: three SGD steps whose gradients differ by the
    summation reorders bounded above). Each rank saves at most 0.55 of the s = 1 activation bytes: every saved tensor
    holds L / 2 positions or H / 2 heads over L (64 positions: no padding); 0.05 covers rotary tables and the like."""
    from long_sequence_sp import tiny_llama

    from hybridzero.plan.memory import activation_bytes

    seq = 64
    hf = tiny_llama(seq).config
    one, two = (activation_bytes(hf, 1, seq, 4, False, s) for s in (1, 2))
    budget_mib = (one + two) / 2 / 2**20
    refused = world(1).run(_example_run, seq, budget_mib, timeout=300)[0]
    assert refused["error"].startswith(f"--seq_len {seq} needs ~"), refused
    assert "sequence_parallel_size = 1, over --budget_mib" in refused["error"]
    reference = world(1).run(_example_run, seq, 0.0, timeout=300)[0]
    for r in world(2).run(_example_run, seq, budget_mib, timeout=300):
        assert r["fits_at_s1"] is False and r["world"] == 2
        for got, want in zip(r["losses"], reference["losses"], strict=True):
            assert abs(got - want) <= 1e-5 * abs(want), (r["losses"], reference["losses"])
        assert 0 < r["saved_activation_bytes"] <= 0.55 * reference["saved_activation_bytes"], (r, reference)

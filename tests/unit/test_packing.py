"""Sample packing: the pure plan/pack/unpack functions, and packed forwards equal to padded ones per token.

Tolerance of the model checks (fp32): a packed row computes, for every real token, the same function of the same
inputs as the padded row; what may differ is the blocking of reductions (matmul K-loops, the softmax sum over a
row of different width whose extra entries are exact zeros). Each such reduction of ``K`` terms carries at most
``K * eps`` relative error (eps = 2**-24); the widest reduction in these models is K = 113 (Llama's vocabulary in
the log-softmax), i.e. ~7e-6 relative per reduction, so ``rtol = atol = 2e-5`` covers a few in series. Observed
differences are ~1e-7 (a single rounding).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from hybridzero.packed_forward import check_packable, packed_lm_loss, packed_logprobs, packed_values
from hybridzero.packing import (
    block_causal_mask,
    cu_seq_lens,
    pack_lists,
    pack_padded,
    packed_slots,
    plan_rows,
    shifted_labels,
    unpack_next_token,
    unpack_tokens,
)
from hybridzero.rlhf.algorithms.ppo import gather_logprobs
from hybridzero.rlhf.models import position_ids
from tests.harness.models import tiny_gpt2, tiny_llama, tiny_opt

TOL = 2e-5
MODELS: dict[str, Callable[[], Any]] = {"llama": tiny_llama, "opt": tiny_opt, "gpt2": tiny_gpt2}


def _padded_batch(vocab: int, lengths: list[int], width: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows alternately left- and right-padded (both layouts the RL code sees), random real tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        lo = (b % 2) * (width - n)
        ids[b, lo : lo + n] = torch.randint(3, vocab, (n,), generator=g)
        mask[b, lo : lo + n] = 1
    return ids, mask


def test_plan_rows_first_fit_decreasing() -> None:
    assert plan_rows([3, 7, 5, 2, 4]) == [[1], [2, 3], [4, 0]]  # capacity 7: 7 | 5+2 | 4+3
    assert plan_rows([2, 2, 2], capacity=4) == [[0, 1], [2]]
    assert plan_rows([5], capacity=5) == [[0]]
    with pytest.raises(ValueError, match="exceeds the row capacity 4"):
        plan_rows([5, 1], capacity=4)
    with pytest.raises(ValueError, match=">= 1 token"):
        plan_rows([3, 0])


def test_pack_padded_round_trip_and_positions() -> None:
    ids, mask = _padded_batch(50, [7, 3, 5, 2], 9)
    p = pack_padded(ids, mask, pad_id=0)
    assert p.token_count() == int(mask.sum()) and packed_slots(mask) == p.input_ids.numel()
    assert int((p.segments >= 0).sum()) == int(mask.sum())  # every real token exactly once
    assert torch.equal(unpack_tokens(p.input_ids, p, 9), ids * mask)
    for k in range(4):  # positions restart at 0 in every sequence
        r, s, n = int(p.row[k]), int(p.start[k]), int(p.length[k])
        assert p.position_ids[r, s : s + n].tolist() == list(range(n))
        assert (p.segments[r, s : s + n] == k).all()
    shifted = unpack_next_token(p.input_ids.roll(-1, dims=1), p, 9)  # slot j holds the token at j + 1
    want = torch.where(mask[:, 1:].bool() & mask[:, :-1].bool(), ids[:, 1:], torch.zeros_like(ids[:, 1:]))
    assert torch.equal(shifted, want)


def test_pack_padded_rejects_gaps_and_empty_rows() -> None:
    ids = torch.ones(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="row 1 of attention_mask has 2 real tokens"):
        pack_padded(ids, torch.tensor([[1, 1, 1, 0, 0], [1, 0, 1, 0, 0]]))
    with pytest.raises(ValueError, match="row 0 of attention_mask has 0 real tokens"):
        pack_padded(ids, torch.tensor([[0, 0, 0, 0, 0], [1, 1, 0, 0, 0]]))
    with pytest.raises(ValueError, match="built from lists"):
        unpack_tokens(torch.zeros(1, 2), pack_lists([[1, 2]], 0), 2)


def test_block_causal_mask_never_crosses_a_boundary() -> None:
    seg = torch.tensor([[0, 0, 1, 1, 1, -1]])
    allowed = block_causal_mask(seg)[0, 0] == 0
    want = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [0, 0, 1, 0, 0, 0],
            [0, 0, 1, 1, 0, 0],
            [0, 0, 1, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],  # a padding slot sees only itself (no empty softmax row)
        ],
        dtype=torch.bool,
    )
    assert torch.equal(allowed, want)
    assert block_causal_mask(seg, torch.bfloat16).min() == torch.finfo(torch.bfloat16).min


def test_shifted_labels_and_cu_seq_lens() -> None:
    p = pack_lists([[5, 6, 7], [8, 9], [4]], pad_id=0, capacity=4)  # rows: [5 6 7 4] [8 9 _ _]
    labels = shifted_labels(p, [[-100, 6, 7], [8, 9], [4]])
    assert labels.tolist() == [[-100, 6, 7, -100], [-100, 9, -100, -100]]
    assert cu_seq_lens(p).tolist() == [0, 3, 4, 6, 8]
    with pytest.raises(ValueError, match="sequence 1 has 2 tokens but 1 labels"):
        shifted_labels(p, [[1, 2, 3], [1], [1]])


def test_check_packable_names_the_implementation() -> None:
    check_packable(tiny_llama().config)
    cfg = tiny_llama().config
    cfg._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="got 'flex_attention'"):
        check_packable(cfg)


def _model(name: str, impl: str) -> Any:
    model = MODELS[name]()
    model.set_attn_implementation(impl)
    return model


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_packed_logprobs_equal_padded(name: str, impl: str) -> None:
    """Next-token log-probs on packed rows = on the padded batch with mask-derived positions (every real
    next token), for rotary (Llama) and learned-position (OPT, GPT-2) models, eager and sdpa."""
    model = _model(name, impl).eval()
    ids, mask = _padded_batch(model.config.vocab_size, [7, 3, 5, 2, 6], 9)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits
        ref = gather_logprobs(logits[:, :-1], ids[:, 1:])
        got = packed_logprobs(model, ids, mask)
    both = (mask[:, 1:] * mask[:, :-1]).bool()
    torch.testing.assert_close(got[both], ref[both], rtol=TOL, atol=TOL)
    assert (got[~both] == 0).all()


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_packed_lm_loss_and_gradients_equal_padded(name: str, impl: str) -> None:
    """SFT: the packed loss is the padded batch's token mean over the same labels, and so are its gradients."""
    examples = [([5, 6, 7, 8, 9], [-100, -100, 7, 8, 9]), ([3, 4, 10], [-100, 4, 10]), ([11, 12], [-100, 12])]
    padded_model, packed_model = _model(name, impl), _model(name, impl)
    width = max(len(e[0]) for e in examples)
    ids = torch.tensor([e[0] + [0] * (width - len(e[0])) for e in examples])
    labels = torch.tensor([e[1] + [-100] * (width - len(e[1])) for e in examples])
    mask = torch.tensor([[1] * len(e[0]) + [0] * (width - len(e[0])) for e in examples])
    ref = padded_model(input_ids=ids, attention_mask=mask, labels=labels).loss
    got, real, slots = packed_lm_loss(packed_model, examples, pad_id=0)
    assert (real, slots) == (10, 10)  # 5 | 3 + 2: no padding at all
    torch.testing.assert_close(got, ref, rtol=TOL, atol=TOL)
    ref.backward()
    got.backward()
    for (n, a), b in zip(padded_model.named_parameters(), packed_model.parameters()):
        assert a.grad is not None and b.grad is not None, n
        torch.testing.assert_close(b.grad, a.grad, rtol=TOL, atol=TOL, msg=n)


def test_packed_values_equal_padded() -> None:
    """A value-head model (critic / reward): values at every real token equal the padded forward's."""
    from hybridzero.rlhf.models import ValueHeadModel

    model = ValueHeadModel(tiny_opt().config, head_seed=3).eval()
    ids, mask = _padded_batch(model.config.vocab_size, [4, 8, 1, 6], 8, seed=2)
    with torch.no_grad():
        ref = model(ids, mask)
        got = packed_values(model, ids, mask)
    torch.testing.assert_close(got[mask.bool()], ref[mask.bool()], rtol=TOL, atol=TOL)


def test_position_ids_alone_do_not_isolate() -> None:
    """Why the block-causal mask: with positions restarting but a plain 2D mask, the second sequence sees the
    first (its logits move far beyond rounding)."""
    model = _model("llama", "sdpa").eval()
    p = pack_lists([[5, 6, 7, 8], [9, 10, 11]], pad_id=0, capacity=7)
    with torch.no_grad():
        alone = model(input_ids=torch.tensor([[9, 10, 11]])).logits[0]
        leaky = model(input_ids=p.input_ids, position_ids=p.position_ids).logits[0, 4:]
        isolated = model(**p.model_kwargs()).logits[0, 4:]
    assert (leaky - alone).abs().max() > 1e-3
    torch.testing.assert_close(isolated, alone, rtol=TOL, atol=TOL)


# --- row capacity: padding against dense-mask attention width (packing.cheapest_capacity) -------------------------


def test_cheapest_capacity_bounds_and_choices() -> None:
    from hybridzero.packing import cheapest_capacity, rows_work

    assert cheapest_capacity([], 1e-3) is None
    same = [40] * 6  # rows of one sequence are already full: wider rows only add attention work
    assert cheapest_capacity(same, 1e-4) == 40
    varied = [97, 60, 55, 51, 49, 90, 103, 48]
    free = cheapest_capacity(varied, 0.0)  # attention free: the fewest slots (wider rows fill better)
    assert free is not None and 103 < free <= 206
    assert rows_work(varied, free, 0.0) < rows_work(varied, 103, 0.0)
    assert cheapest_capacity(varied, 1.0) == 103  # attention dominant: rows as narrow as the longest sequence
    for ratio in (0.0, 3e-4, 1e-2):
        cap = cheapest_capacity(varied, ratio)
        assert cap is not None and 103 <= cap <= 206
        assert cheapest_capacity(list(varied), ratio) == cap  # deterministic


def test_attention_pair_ratio_from_config_shape() -> None:
    from transformers import GPT2Config, LlamaConfig

    from hybridzero.packed_forward import attention_pair_ratio

    llama = LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3
    )
    d, layers = 576, 30
    per_slot = 2 * layers * (2 * d * d + 2 * d * (d // 3) + 3 * d * 1536)  # gated MLP: three matrices
    assert attention_pair_ratio(llama) == pytest.approx(4 * d * layers / per_slot)
    gpt2 = GPT2Config(n_embd=48, n_layer=2, n_head=4)
    assert attention_pair_ratio(gpt2) == pytest.approx(4 * 48 * 2 / (2 * 2 * (4 * 48 * 48 + 2 * 48 * 192)))
    assert attention_pair_ratio(object()) is None


def test_row_capacity_follows_the_attention_implementation() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from hybridzero.packed_forward import row_capacity

    cfg = LlamaConfig(hidden_size=40, intermediate_size=52, num_hidden_layers=2, num_attention_heads=5, vocab_size=67)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg)
    lengths = [9, 17, 5, 12]
    assert row_capacity(model, lengths, 30) == 30  # the caller's
    assert 17 <= (row_capacity(model, lengths) or 0) <= 34
    model.config._attn_implementation = "flash_attention_2"
    assert row_capacity(model, lengths) == sum(lengths)  # one row: flash's cost follows the segments

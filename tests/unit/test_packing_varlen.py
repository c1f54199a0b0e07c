"""Packing through flash-attention's varlen path, on CPU: packed forwards of models whose attention
implementation is flash-type get no mask, flattened rows and ``cu_seq_lens``/``max_length`` keyword arguments,
and equal the padded ``sdpa`` forward per token.

No ``flash_attn`` here: the attention is :class:`tests.harness.varlen_reference.ReferenceVarlen`, a per-segment
causal attention computed from the keyword arguments it receives (raising without them), registered through
transformers' ``AttentionInterface`` / ``AttentionMaskInterface`` under a name containing ``"flash"`` (how
transformers recognises flash attention). What this checks: that every HF family here forwards the kwargs to its
attention function, that hybridzero builds them right (boundaries, dtypes, the mask left out), and the unpacking.
What it cannot: ``flash_attn_varlen_func`` itself and transformers' ``_flash_attention_forward`` around it (a GPU
with ``flash_attn`` runs those; the README says so).

Tolerance (fp32) as in ``tests/unit/test_packing.py``: the same function of the same inputs per real token, only
reduction blocking differs (here also the attention kernel: the reference's einsum/softmax vs sdpa's); each reduction
of ``K <= 113`` terms is within ``K * 2**-24`` ~ 7e-6 relative, so ``rtol = atol = 2e-5`` covers a few in series.
Observed: log-prob gaps <= 4.8e-7, loss gaps 0, gradient gaps <= 1.2e-7.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids
from transformers.utils.generic import is_flash_attention_requested

from hybridzero.packed_forward import (
    check_packable,
    is_varlen_attention,
    packed_last_values,
    packed_lm_loss,
    packed_logprobs,
    packed_values,
)
from hybridzero.packing import pack_lists, varlen_kwargs
from hybridzero.rlhf.algorithms.ppo import gather_logprobs
from hybridzero.rlhf.models import ValueHeadModel, position_ids
from hybridzero.token_budget import budget_lm_sums
from tests.harness.models import tiny_gpt2, tiny_llama, tiny_opt
from tests.harness.varlen_reference import NAME, ReferenceVarlen, register, use_reference
from tests.unit.test_packing import _padded_batch

TOL = 2e-5
MODELS: dict[str, Callable[[], Any]] = {"llama": tiny_llama, "opt": tiny_opt, "gpt2": tiny_gpt2}
EXAMPLES = [([5, 6, 7, 8, 9], [-100, -100, 7, 8, 9]), ([3, 4, 10], [-100, 4, 10]), ([11, 12], [-100, 12])]


@pytest.fixture
def reference() -> ReferenceVarlen:
    return register()


def _sdpa(name: str) -> Any:
    model = MODELS[name]()
    model.set_attn_implementation("sdpa")
    return model


def test_is_varlen_attention_agrees_with_transformers() -> None:
    names = ["eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3", "flash_attention_4"]
    names += ["kernels-community/flash-attn2", "kernels-community/vllm-flash-attn3", NAME, "hybridzero_ulysses_ab"]
    for impl in names:
        assert is_varlen_attention(impl) == is_flash_attention_requested(requested_attention_implementation=impl), impl
    cfg = tiny_llama().config
    for impl in ("flash_attention_2", "flash_attention_3", NAME):
        cfg._attn_implementation = impl
        check_packable(cfg)
    cfg._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="or a flash-attention one .* got 'flex_attention'"):
        check_packable(cfg)


def test_varlen_kwargs_match_transformers_position_inference() -> None:
    """Our ``cu_seq_lens`` = what transformers infers from the flattened positions for the real sequences; a
    padding tail is one segment here and single-slot ones there (its outputs are never read)."""
    tight = varlen_kwargs(pack_lists([[5, 6, 7], [8, 9], [4]], pad_id=0))  # rows [5 6 7] [8 9 4]: no tail
    assert tight["input_ids"].tolist() == [[5, 6, 7, 8, 9, 4]] and tight["position_ids"].tolist() == [
        [0, 1, 2, 0, 1, 0]
    ]
    assert tight["cu_seq_lens_q"].dtype == torch.int32 and tight["cu_seq_lens_q"].tolist() == [0, 3, 5, 6]
    assert tight["cu_seq_lens_k"] is tight["cu_seq_lens_q"] and tight["max_length_q"] == tight["max_length_k"] == 3
    (theirs, _), (longest, _) = prepare_fa_kwargs_from_position_ids(tight["position_ids"])
    assert torch.equal(theirs, tight["cu_seq_lens_q"]) and int(longest) == 3
    packed = pack_lists([[5, 6, 7], [8, 9], [4]], pad_id=0, capacity=4)  # [5 6 7 4] [8 9 _ _]
    tail = varlen_kwargs(packed)
    (theirs, _), _ = prepare_fa_kwargs_from_position_ids(tail["position_ids"])
    assert tail["cu_seq_lens_q"].tolist() == [0, 3, 4, 6, 8] and theirs.tolist() == [0, 3, 4, 6, 7, 8]
    assert "attention_mask" not in packed.model_kwargs(varlen=True)


@pytest.mark.parametrize("capacity", [None, 9])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_packed_logprobs_varlen_equal_padded_sdpa(name: str, capacity: int | None, reference: ReferenceVarlen) -> None:
    """Rotary (Llama, GQA 5:1) and learned-position (OPT with project_in/out, GPT-2) models: the varlen packed
    forward's next-token log-probs = the padded sdpa forward's, one row of all tokens (default) or rows of 9
    flattened with their padding tails as segments."""
    model = _sdpa(name).eval()
    ids, mask = _padded_batch(model.config.vocab_size, [7, 3, 5, 2, 6], 9)
    with torch.no_grad():
        ref = gather_logprobs(
            model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits[:, :-1], ids[:, 1:]
        )
        got = packed_logprobs(use_reference(model), ids, mask, capacity=capacity)
    assert reference.calls == model.config.num_hidden_layers  # one forward, through the reference at every layer
    if capacity is None:
        assert len(reference.last_bounds) == 6 and reference.last_bounds[-1] == int(mask.sum())  # 5 sequences
    both = (mask[:, 1:] * mask[:, :-1]).bool()
    torch.testing.assert_close(got[both], ref[both], rtol=TOL, atol=TOL)
    assert (got[~both] == 0).all()


@pytest.mark.parametrize("capacity", [None, 9])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_packed_logprobs_varlen_wanted_positions_only(
    name: str, capacity: int | None, reference: ReferenceVarlen
) -> None:
    """The output head on the wanted positions only (hybridzero.head_select) through the flattened ``[1, R * W]``
    rows of the varlen path: the head sees exactly the wanted slots, their log-probs = the padded sdpa forward's,
    every other position 0."""
    model = _sdpa(name).eval()
    ids, mask = _padded_batch(model.config.vocab_size, [7, 3, 5, 2, 6], 9)
    both = (mask[:, 1:] * mask[:, :-1]).bool()
    wanted = both.clone()
    wanted[:, :3] = False  # an "answer" region: later positions only
    seen: list[int] = []
    handle = model.get_output_embeddings().register_forward_hook(
        lambda _m, args, _o: seen.append(int(args[0].shape[:-1].numel()))
    )
    with torch.no_grad():
        ref = gather_logprobs(
            model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits[:, :-1], ids[:, 1:]
        )
        seen.clear()
        got = packed_logprobs(use_reference(model), ids, mask, capacity=capacity, wanted=wanted)
    handle.remove()
    assert reference.calls == model.config.num_hidden_layers
    assert seen == [int(wanted.sum())]
    torch.testing.assert_close(got[wanted], ref[wanted], rtol=TOL, atol=TOL)
    assert (got[~wanted] == 0).all()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_packed_lm_loss_varlen_gradients_equal_padded(name: str, reference: ReferenceVarlen) -> None:
    """The packed training step: loss and every parameter gradient = the padded sdpa batch's."""
    padded_model, packed_model = _sdpa(name), use_reference(MODELS[name]())
    width = max(len(e[0]) for e in EXAMPLES)
    ids = torch.tensor([e[0] + [0] * (width - len(e[0])) for e in EXAMPLES])
    labels = torch.tensor([e[1] + [-100] * (width - len(e[1])) for e in EXAMPLES])
    mask = torch.tensor([[1] * len(e[0]) + [0] * (width - len(e[0])) for e in EXAMPLES])
    ref = padded_model(input_ids=ids, attention_mask=mask, labels=labels).loss
    got, real, slots = packed_lm_loss(packed_model, EXAMPLES, pad_id=0)
    assert (real, slots) == (10, 10) and reference.last_bounds == [0, 5, 8, 10]  # one row, no padding slot
    torch.testing.assert_close(got, ref, rtol=TOL, atol=TOL)
    ref.backward()
    got.backward()
    for (n, a), b in zip(padded_model.named_parameters(), packed_model.parameters()):
        assert a.grad is not None and b.grad is not None, n
        torch.testing.assert_close(b.grad, a.grad, rtol=TOL, atol=TOL, msg=n)


@pytest.mark.parametrize("name", ["llama", "opt"])
def test_packed_values_varlen_equal_padded(name: str, reference: ReferenceVarlen) -> None:
    """A value-head model (critic values, reward scores): its trunk gets the varlen kwargs through
    ``ValueHeadModel.forward``; values and last-token scores = the padded sdpa forward's."""
    model = ValueHeadModel(MODELS[name]().config, head_seed=3).eval()
    trunk: Any = model.transformer
    trunk.set_attn_implementation("sdpa")
    ids, mask = _padded_batch(model.config.vocab_size, [4, 8, 1, 6], 8, seed=2)
    with torch.no_grad():
        ref = model(ids, mask)
        ref_scores = model.score(ids, mask)
        use_reference(model)
        got = packed_values(model, ids, mask)
        scores = packed_last_values(model, ids, mask)
    assert reference.calls == 2 * model.config.num_hidden_layers
    torch.testing.assert_close(got[mask.bool()], ref[mask.bool()], rtol=TOL, atol=TOL)
    torch.testing.assert_close(scores, ref_scores, rtol=TOL, atol=TOL)


class _OneRank:
    """What :func:`budget_lm_sums` needs of an engine, at world 1: the model, a device, and a MAX all-reduce over
    one rank (the identity); no sequence parallelism."""

    sequence_parallel = None

    def __init__(self, model: Any) -> None:
        self.module, self.device, self.comm = model, torch.device("cpu"), self

    def all_reduce(self, t: torch.Tensor, op: str = "sum", phase: str = "") -> None:
        del t, op, phase

    def __call__(self, **kwargs: Any) -> Any:
        return self.module(**kwargs)


def test_token_budget_varlen_equals_padded(reference: ReferenceVarlen) -> None:
    """``--max_tokens_per_batch``: chunks of <= 6 tokens, each one flattened row, sum to the padded batch's
    summed cross-entropy and label count."""
    examples = [*EXAMPLES, ([13, 14, 15, 16], [13, 14, 15, 16])]
    padded = _sdpa("llama")
    width = max(len(e[0]) for e in examples)
    ids = torch.tensor([e[0] + [0] * (width - len(e[0])) for e in examples])
    labels = torch.tensor([e[1] + [-100] * (width - len(e[1])) for e in examples])
    mask = (torch.arange(width)[None] < torch.tensor([len(e[0]) for e in examples])[:, None]).long()
    with torch.no_grad():
        logits = padded(input_ids=ids, attention_mask=mask).logits
        want = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), reduction="sum")
        nll, count = budget_lm_sums(_OneRank(use_reference(tiny_llama())), examples, pad_id=0, max_tokens=6)
    assert count == int((labels[:, 1:] != -100).sum()) and reference.calls == 2 * 3  # 5 | 4 + 2 | 3: 3 chunks
    assert abs(nll - float(want)) <= TOL * (1 + abs(float(want)))


def test_reference_fails_loudly_without_the_varlen_kwargs(reference: ReferenceVarlen) -> None:
    """The test bites: flattened rows without ``cu_seq_lens`` (or with the dense mask) never reach a result."""
    model = use_reference(tiny_llama()).eval()
    packed = pack_lists([[5, 6, 7, 8], [9, 10, 11]], pad_id=0, capacity=7)
    flat = varlen_kwargs(packed)
    with torch.no_grad(), pytest.raises(ValueError, match="got no cu_seq_lens_q, cu_seq_lens_k"):
        model(input_ids=flat["input_ids"], position_ids=flat["position_ids"])
    with torch.no_grad(), pytest.raises(ValueError, match="flash varlen takes no mask"):
        model(**packed.model_kwargs(varlen=False))
    assert reference.calls == 0


def test_segments_decide_what_a_token_sees(reference: ReferenceVarlen) -> None:
    """With one segment over the whole row the second sequence attends to the first (its logits move far beyond
    rounding); with ``varlen_kwargs``' boundaries it equals the sequence forwarded alone."""
    model = use_reference(tiny_llama()).eval()
    flat = varlen_kwargs(pack_lists([[5, 6, 7, 8], [9, 10, 11]], pad_id=0, capacity=7))
    merged = {**flat, "cu_seq_lens_q": torch.tensor([0, 7], dtype=torch.int32), "max_length_q": 7}
    merged.update(cu_seq_lens_k=merged["cu_seq_lens_q"], max_length_k=7)
    with torch.no_grad():
        alone = _sdpa("llama").eval()(input_ids=torch.tensor([[9, 10, 11]])).logits[0]
        isolated = model(**flat).logits[0, 4:]
        leaky = model(**merged).logits[0, 4:]
    assert (leaky - alone).abs().max() > 1e-3
    torch.testing.assert_close(isolated, alone, rtol=TOL, atol=TOL)

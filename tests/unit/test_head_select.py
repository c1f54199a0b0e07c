"""The output head on the wanted positions only (hybridzero.head_select) and its use by the log-prob paths."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from hybridzero.head_select import kept_logits, next_token_logprobs_at, output_head
from hybridzero.packed_forward import packed_logprobs
from hybridzero.rlhf.rollout.generate import causal_kwargs, sequence_logprobs

VOCAB = 67


def _llama(tied: bool) -> nn.Module:
    cfg = LlamaConfig(
        hidden_size=40,
        intermediate_size=52,
        num_hidden_layers=2,
        num_attention_heads=5,
        num_key_value_heads=5,
        vocab_size=VOCAB,
        tie_word_embeddings=tied,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg)


def _gpt2() -> nn.Module:
    cfg = GPT2Config(n_embd=40, n_layer=2, n_head=5, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "sdpa"
    return GPT2LMHeadModel(cfg)


MODELS = {"llama-tied": lambda: _llama(True), "llama": lambda: _llama(False), "gpt2": _gpt2}


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left- and right-padded rows; wanted: the 'answer' positions 6.. where the next token is real."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (4, 13), generator=g)
    mask = torch.ones(4, 13, dtype=torch.long)
    mask[0, :3] = 0
    mask[1, 10:] = 0
    mask[2, :1] = 0
    mask[2, 12:] = 0
    wanted = torch.zeros(4, 12, dtype=torch.bool)
    wanted[:, 6:] = True
    return ids, mask, wanted & mask[:, 1:].bool()


class _HeadRows:
    """Records how many rows of hidden states the output head saw per call."""

    def __init__(self, model: nn.Module) -> None:
        head = output_head(model)
        assert head is not None
        self.seen: list[int] = []
        self.handle = head.register_forward_hook(self._hook)

    def _hook(self, _m: nn.Module, args: tuple[Any, ...], _out: Any) -> None:
        self.seen.append(int(args[0].shape[:-1].numel()))


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("packed", [True, False])
def test_wanted_logprobs_equal_full_and_head_sees_only_them(name: str, packed: bool) -> None:
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    ids, mask, wanted = _batch()
    full = sequence_logprobs(model, ids, mask, packed=packed)
    rows = _HeadRows(model)
    part = sequence_logprobs(model, ids, mask, packed=packed, wanted=wanted)
    rows.handle.remove()
    assert rows.seen == [int(wanted.sum())]  # the head ran on the wanted slots only
    # same function of the same hidden state; the head's matmul may block its sums differently for fewer rows
    assert torch.allclose(part[wanted], full[wanted], rtol=0, atol=1e-5)
    assert bool((part[~wanted] == 0).all())


@pytest.mark.parametrize("packed", [True, False])
def test_gradient_through_wanted_positions_equals_full(packed: bool) -> None:
    torch.manual_seed(1)
    model = _llama(tied=True)
    ids, mask, wanted = _batch()
    grads = []
    for w in (None, wanted):
        model.zero_grad()
        sequence_logprobs(model, ids, mask, packed=packed, wanted=w)[wanted].sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_packed_wanted_shape_is_checked() -> None:
    model = _llama(tied=False)
    ids, mask, wanted = _batch()
    with pytest.raises(ValueError, match=r"wanted: shape \(4, 11\), expected \(4, 12\)"):
        packed_logprobs(model, ids, mask, wanted=wanted[:, 1:])


def test_last_column_cannot_be_kept() -> None:
    model = _llama(tied=False)
    ids, mask, _ = _batch()
    keep = torch.zeros(ids.shape, dtype=torch.bool)
    keep[0, -1] = True
    with pytest.raises(ValueError, match="last slot"):
        next_token_logprobs_at(model, causal_kwargs(ids, mask), ids, keep)


class _NoHead(nn.Module):
    """A causal LM without output embeddings: the selection falls back to the full logits."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, **kwargs: Any) -> Any:
        return self.inner(**kwargs)


def test_model_without_output_head_gets_the_same_selection() -> None:
    torch.manual_seed(2)
    inner = _llama(tied=False).eval()
    ids, mask, _ = _batch()
    keep = torch.zeros(ids.shape, dtype=torch.bool)
    keep[:, 4:9] = True
    wrapped = _NoHead(inner)
    assert output_head(wrapped) is None
    kwargs = causal_kwargs(ids, mask)
    expected = inner(**kwargs).logits[keep]
    assert torch.equal(kept_logits(wrapped, kwargs, keep), expected)
    assert torch.allclose(kept_logits(inner, kwargs, keep), expected, rtol=0, atol=1e-5)


def test_head_with_other_input_shape_is_left_alone() -> None:
    """A keep mask that does not match the head's input (here: a different batch) changes nothing in the forward;
    the selection then happens after the full logits."""
    torch.manual_seed(4)
    model = _llama(tied=True).eval()
    ids, mask, _ = _batch()
    keep = torch.zeros(ids.shape, dtype=torch.bool)
    keep[1, 2:5] = True
    kwargs = causal_kwargs(ids[:2], mask[:2])
    with pytest.raises(IndexError):  # the mask is for 4 rows, the logits have 2: no silent misuse
        kept_logits(model, kwargs, keep)

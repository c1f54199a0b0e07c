"""Tiny Hugging Face causal language models built from configs (no downloads).

Every factory seeds the global torch RNG with ``seed`` right before construction, so the
same seed gives bit-identical fp32 weights.  All models use eager attention and zero
dropout, so forward passes are deterministic too.

Dimensions are chosen so that the numel of every transformer block and the numel of all
non-block parameters (tied weights counted once) are coprime with 12: none of these counts
is divisible by 2, 3 or 4.  A sharded engine running these models on 2, 3 or 4 ranks
therefore always has to pad, and never splits a block evenly by accident.

===========  ==================================================  =========  ===========
name         dims                                                block      non-block
===========  ==================================================  =========  ===========
llama        V=113 h=35 I=67 heads=5 kv_heads=1 head_dim=8       10465      7945
opt          V=99 h=25 proj=21 ffn=48 heads=5 pos=126 pre-LN     5173       6379
opt_postln   same as opt, post-LN (no final layer norm)          5173       6329
(opt, project=False, pre-LN / post-LN)                           5173       5725/5675
gpt2_tied    V=98 h=35 inner=48 heads=7 pos=127                  8623       7945
gpt2_untied  same, separate lm_head                              8623       11375
===========  ==================================================  =========  ===========

Each model has 2 transformer blocks unless ``num_hidden_layers`` / ``n_layer`` is overridden.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
import transformers
from torch import nn

__all__ = [
    "MODEL_FACTORIES",
    "ScalarLMOutput",
    "WithScalar",
    "block_numels",
    "find_blocks",
    "rest_numel",
    "tiny_gpt2",
    "tiny_llama",
    "tiny_opt",
]

_M = TypeVar("_M", bound=nn.Module)


def _finish(model: _M) -> _M:
    """Put a freshly built model in fp32 train mode (dropout is 0 anyway)."""
    model.to(torch.float32)
    model.train()
    return model


def tiny_llama(seed: int = 0, **overrides: Any) -> transformers.LlamaForCausalLM:
    """A 2-block Llama with grouped-query attention (5 query heads share 1 kv head).

    ``head_dim`` is explicit (8, even as rotary embeddings need) and ``5 * 8 != hidden_size``,
    so code that assumes ``hidden_size == heads * head_dim`` breaks visibly.  Embeddings are
    untied (the Llama default).  ``overrides`` are passed to ``LlamaConfig``.
    """
    kwargs: dict[str, Any] = dict(
        vocab_size=113,
        hidden_size=35,
        intermediate_size=67,
        num_hidden_layers=2,
        num_attention_heads=5,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=256,
        attention_dropout=0.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    kwargs.setdefault("attn_implementation", "eager")
    config = transformers.LlamaConfig(**kwargs)
    torch.manual_seed(seed)
    return _finish(transformers.LlamaForCausalLM(config))


def block_dominated_llama(layers: int, seed: int = 0) -> transformers.LlamaForCausalLM:
    """A Llama whose blocks dominate its size (hidden 512, intermediate 2047, vocab 101: ~3.8 M elements a block),
    for the memory and export tests (build it under ``torch.device("meta")`` for a meta model)."""
    return tiny_llama(
        seed,
        hidden_size=512,
        intermediate_size=2047,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=101,
        num_hidden_layers=layers,
    )


def tiny_opt(
    seed: int = 0, *, project: bool = True, pre_ln: bool = True, **overrides: Any
) -> transformers.OPTForCausalLM:
    """A 2-block OPT with tied input/output embeddings (the OPT default).

    ``project=True`` sets ``word_embed_proj_dim`` (21) != ``hidden_size`` (25), so the
    decoder owns ``project_in``/``project_out``.  ``pre_ln=False`` builds the post-LN
    variant (``do_layer_norm_before=False``), which has no final layer norm.
    """
    hidden = int(overrides.get("hidden_size", 25))
    kwargs: dict[str, Any] = dict(
        vocab_size=99,
        hidden_size=hidden,
        word_embed_proj_dim=21 if project else hidden,
        ffn_dim=48,
        num_hidden_layers=2,
        num_attention_heads=5,
        max_position_embeddings=126,
        do_layer_norm_before=pre_ln,
        dropout=0.0,
        attention_dropout=0.0,
        layerdrop=0.0,
        pad_token_id=1,
        bos_token_id=2,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    kwargs.update(overrides)
    kwargs.setdefault("attn_implementation", "eager")
    config = transformers.OPTConfig(**kwargs)
    torch.manual_seed(seed)
    return _finish(transformers.OPTForCausalLM(config))


def tiny_gpt2(seed: int = 0, *, tied: bool = True, **overrides: Any) -> transformers.GPT2LMHeadModel:
    """A 2-block GPT-2 (Conv1D projections, learned positions); ``tied`` ties ``lm_head`` to ``wte``."""
    kwargs: dict[str, Any] = dict(
        vocab_size=98,
        n_positions=127,
        n_embd=35,
        n_inner=48,
        n_layer=2,
        n_head=7,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        summary_first_dropout=0.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=tied,
    )
    kwargs.update(overrides)
    kwargs.setdefault("attn_implementation", "eager")
    config = transformers.GPT2Config(**kwargs)
    torch.manual_seed(seed)
    return _finish(transformers.GPT2LMHeadModel(config))


def _opt_postln(seed: int = 0, **overrides: Any) -> transformers.OPTForCausalLM:
    return tiny_opt(seed, pre_ln=False, **overrides)


def _gpt2_untied(seed: int = 0, **overrides: Any) -> transformers.GPT2LMHeadModel:
    return tiny_gpt2(seed, tied=False, **overrides)


MODEL_FACTORIES: dict[str, Callable[..., nn.Module]] = {
    "llama": tiny_llama,
    "opt": tiny_opt,
    "opt_postln": _opt_postln,
    "gpt2_tied": tiny_gpt2,
    "gpt2_untied": _gpt2_untied,
}
"""Name -> ``factory(seed=0, **overrides)``.  Treat as read-only."""


def find_blocks(model: nn.Module) -> nn.ModuleList:
    """The transformer-block list of ``model``: its ``nn.ModuleList`` holding the most parameters.

    Works through wrappers such as :class:`WithScalar`.  Raises ``ValueError`` if the model
    has no ``ModuleList``.
    """
    best: nn.ModuleList | None = None
    best_numel = -1
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            numel = sum(p.numel() for p in module.parameters())
            if numel > best_numel:
                best, best_numel = module, numel
    if best is None:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of blocks")
    return best


def block_numels(model: nn.Module) -> list[int]:
    """Parameter numel of each transformer block, in order."""
    return [sum(p.numel() for p in block.parameters()) for block in find_blocks(model)]


def rest_numel(model: nn.Module) -> int:
    """Numel of every parameter outside the blocks, each shared (tied) tensor counted once."""
    in_blocks = {id(p) for p in find_blocks(model).parameters()}
    return sum(p.numel() for p in model.parameters() if id(p) not in in_blocks)


@dataclass
class ScalarLMOutput:
    """HF-like output of :class:`WithScalar`: ``loss`` is ``None`` when no labels were given."""

    loss: torch.Tensor | None
    logits: torch.Tensor


class WithScalar(nn.Module):
    """Wraps a causal LM and multiplies its logits by a learnable 0-dim ``logit_scale`` (init 1.0).

    ``logit_scale`` has numel 1 — smaller than any world size > 1 — so every sharding
    scheme meets a parameter that leaves most ranks with an empty or padding-only shard.
    The loss is the mean shifted cross-entropy of the scaled logits against ``labels``
    (positions equal to -100 are ignored), exactly like Hugging Face causal LMs.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.logit_scale = nn.Parameter(torch.ones((), dtype=torch.float32))

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> ScalarLMOutput:
        """Scaled logits ``[batch, seq, vocab]`` and, given ``labels``, the shifted CE loss."""
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        logits = out.logits * self.logit_scale
        loss = None
        if labels is not None:
            shifted = logits[:, :-1, :].reshape(-1, logits.shape[-1]).float()
            loss = F.cross_entropy(shifted, labels[:, 1:].reshape(-1), ignore_index=-100)
        return ScalarLMOutput(loss=loss, logits=logits)

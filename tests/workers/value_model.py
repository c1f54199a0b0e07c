"""A scalar-value model for RLHF tests: a tiny OPT base (no LM head) plus a linear value head.

DeepSpeed-Chat's critic and reward models are exactly this shape: a causal LM trunk whose last hidden state is
projected to one number per position. The critic's values at the generated positions are its value estimates; the
reward model's value at the last position is the sequence's score.

Invariants: :class:`ValueModel` built with the same ``seed`` has bit-identical fp32 weights (``tiny_opt`` seeds the
global torch RNG before construction and the head is initialised from a private generator seeded from ``seed``).
The head is an elementwise product and a sum, not ``nn.Linear(width, 1)``: on CPU a one-output linear takes a
matrix-vector path whose rounding depends on the 16-byte alignment of the weight's address, and a sharded engine
binds parameters as views at arbitrary offsets of a flat buffer. Elementwise ops round the same at any address, so
the sharded and the unsharded model stay bit-for-bit comparable.
"""

from __future__ import annotations

import torch
from torch import nn

from tests.harness.models import tiny_opt

__all__ = ["ValueModel"]


class ValueModel(nn.Module):
    """``tiny_opt(seed)``'s decoder trunk (``OPTModel``: token embedding, positions, project_in/out, 2 blocks, final
    norm) and a bias-free linear value head ``v_head`` of ``word_embed_proj_dim`` weights."""

    def __init__(self, seed: int = 0) -> None:
        """Trunk from ``tiny_opt(seed)``; head weights ``N(0, 1/width)`` from a generator seeded ``seed + 7919``."""
        super().__init__()
        self.base = tiny_opt(seed).model
        width = int(self.base.config.word_embed_proj_dim)
        generator = torch.Generator().manual_seed(seed + 7919)
        self.v_head = nn.Parameter(torch.randn(width, generator=generator) * width**-0.5)
        self.train()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Values ``[batch, seq]`` (fp32): the head applied to the trunk's last hidden state at every position."""
        hidden = self.base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return (hidden * self.v_head).sum(-1)

"""A pure-torch reference for flash-attention's varlen path, registered with transformers for CPU tests.

Transformers' flash path (``integrations/flash_attention.py`` -> ``_flash_attention_forward``) needs the
``flash_attn`` package (or a ``kernels`` hub kernel) and a GPU; neither is here. What hybridzero controls is what
reaches that path: with packed rows it gets no mask, ``query [B, H, L, D]`` of the flattened rows, and the
``cu_seq_lens_q/k`` / ``max_length_q/k`` keyword arguments, on which ``_flash_attention_forward`` calls
``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True, ...)`` on the
tokens flattened to ``[B * L, H, D]``: causal attention inside each segment ``[cu[i], cu[i + 1])``.
:class:`ReferenceVarlen` computes exactly that from the keyword arguments it receives, segment by segment, and
fails loudly when they are missing or malformed (so a path that drops them cannot pass by accident).

The name matters: transformers (and :func:`hybridzero.packed_forward.is_varlen_attention`) treat an attention
implementation as flash when its name contains ``"flash"`` (``transformers.utils.generic.
is_flash_attention_requested``), so :data:`NAME` contains it, and its mask function is transformers' own
``flash_attention_mask`` (what ``flash_attention_2`` uses: no mask unless a 2D padding mask has zeros). Transformers
5.19 refuses to *select* such a name through ``set_attn_implementation`` / ``from_pretrained(attn_implementation=)``
(it tries to preload a flash kernel for any "flash" name that is not ``flash_attention_N``), so :func:`use_reference`
sets the config's ``_attn_implementation`` (its public setter, which also sets sub-configs), as sequence
parallelism does for its Ulysses attention.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

NAME = "flash_reference_varlen"
VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")

__all__ = ["NAME", "ReferenceVarlen", "register", "use_reference"]


def _check_cu(cu: Any, tokens: int, max_length: Any, key: str) -> list[int]:
    """``cu`` as a list of boundaries; raises unless it is flash's int32 ``[n + 1]`` from 0 to ``tokens``,
    increasing, with ``max_length`` at least its longest segment."""
    if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.ndim != 1 or cu.numel() < 2:
        raise ValueError(f"{key} must be a 1-D int32 tensor of >= 2 boundaries, got {cu!r}")
    bounds = [int(x) for x in cu.tolist()]
    if bounds[0] != 0 or bounds[-1] != tokens or any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"{key} must rise strictly from 0 to the {tokens} flattened tokens, got {bounds}")
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    if int(max_length) < longest:
        raise ValueError(f"max_length for {key} is {int(max_length)}, below its longest segment {longest}")
    return bounds


class ReferenceVarlen:
    """Transformers' attention-function signature over a per-segment causal attention (module docstring).

    ``calls`` counts the calls (a test can tell this path ran); ``last_bounds`` holds the last call's boundaries.
    Causal only (every model here is a decoder), no dropout, no sliding window: anything else raises."""

    def __init__(self) -> None:
        self.calls = 0
        self.last_bounds: list[int] = []

    def __call__(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        """``query [B, H, L, D]``, ``key``/``value [B, H_kv, L, D]`` -> ``([B, L, H, D], None)``."""
        if attention_mask is not None:
            raise ValueError(f"flash varlen takes no mask, got attention_mask {tuple(attention_mask.shape)}")
        missing = [k for k in VARLEN_KEYS if kwargs.get(k) is None]
        if missing:
            raise ValueError(f"reference varlen attention got no {', '.join(missing)}: packed rows were not passed")
        if dropout or kwargs.get("sliding_window") is not None or kwargs.get("is_causal", True) is False:
            raise ValueError("reference varlen attention: causal, no dropout, no sliding window only")
        b, heads, length, dim = query.shape
        bounds = _check_cu(kwargs["cu_seq_lens_q"], b * length, kwargs["max_length_q"], "cu_seq_lens_q")
        if _check_cu(kwargs["cu_seq_lens_k"], b * length, kwargs["max_length_k"], "cu_seq_lens_k") != bounds:
            raise ValueError("self-attention: cu_seq_lens_k must equal cu_seq_lens_q")
        groups = heads // key.shape[1]
        q = query.transpose(1, 2).reshape(b * length, heads, dim)  # [N, H, D]: the flattened tokens
        k = key.transpose(1, 2).reshape(b * length, -1, dim).repeat_interleave(groups, dim=1)
        v = value.transpose(1, 2).reshape(b * length, -1, value.shape[-1]).repeat_interleave(groups, dim=1)
        scale = dim**-0.5 if scaling is None else scaling
        parts = []
        for lo, hi in zip(bounds, bounds[1:]):
            scores = torch.einsum("qhd,khd->hqk", q[lo:hi], k[lo:hi]) * scale  # [H, n, n]
            causal = torch.ones(hi - lo, hi - lo, dtype=torch.bool, device=q.device).tril()
            weights = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
            parts.append(torch.einsum("hqk,khd->qhd", weights, v[lo:hi]))
        self.calls += 1
        self.last_bounds = bounds
        return torch.cat(parts).reshape(b, length, heads, -1), None


def register() -> ReferenceVarlen:
    """Register a fresh :class:`ReferenceVarlen` under :data:`NAME` (attention and mask interfaces); returns it."""
    reference = ReferenceVarlen()
    AttentionInterface.register(NAME, reference)
    AttentionMaskInterface.register(NAME, flash_attention_mask)
    return reference


def use_reference(model: nn.Module) -> nn.Module:
    """Select :data:`NAME` on ``model``'s config (module docstring: why not ``set_attn_implementation``)."""
    config: Any = getattr(model, "config")  # noqa: B009 - nn.Module's typing has no config
    config._attn_implementation = NAME
    return model

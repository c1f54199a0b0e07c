"""Ulysses attention: heads exchanged for sequence with two all-to-alls per layer and forward (and two in backward).

Every rank of a sequence-parallel group of ``s`` ranks holds a contiguous slice of ``L / s`` positions of every
sequence (rank ``r`` holds ``[r L/s, (r+1) L/s)``) and all ``H`` heads of its projections. Around the model's own
attention kernel ("core"):

1. one all-to-all sends head chunk ``j`` of q, k and v (packed into one buffer) to rank ``j``; afterwards rank ``j``
   holds the whole sequence for its ``H / s`` query heads and their ``H_kv / s`` kv heads;
2. the core runs on the full sequence, causal over global positions (the mask is built here from the full length,
   never taken from the model, which only knows its local slice);
3. one all-to-all sends the output back: rank ``r`` gets positions ``[r L/s, (r+1) L/s)`` of every head.

The exchange moves values and never combines them, so it is exact; the only numerical difference from ``s = 1`` is
the core's reduction order on a different head partition (none for per-head kernels such as eager and SDPA on CPU).
Grouped-query attention with ``H_kv`` not divisible by ``s`` repeats each kv head ``H / H_kv`` times before the
exchange (so every rank has the kv heads of its query heads; more bytes, same values).

The exchange's backward is the same all-to-all (it is a permutation that is its own inverse), recorded in the ledger
in phase "backward".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hybridzero.comm.collectives import Comm

LABEL = "sp_all_to_all"
CoreAttention = Callable[..., tuple[torch.Tensor, Any]]


class _Exchange(torch.autograd.Function):
    """``[s, ...]`` chunk ``i`` to rank ``i``; chunk ``i`` of the result came from rank ``i``. Self-adjoint."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        x = x.contiguous()
        out = torch.empty_like(x)  # contiguous too (empty_like keeps strides): the transport writes rank-major
        comm.all_to_all(out, x, phase="forward", label=LABEL)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        ctx.comm.all_to_all(out, grad, phase="backward", label=LABEL)
        return out, None


def exchange(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """The differentiable all-to-all of a rank-major ``[s, ...]`` tensor over ``comm``."""
    return _Exchange.apply(x, comm)


def seq_to_heads(qkv: torch.Tensor, s: int, comm: Comm) -> torch.Tensor:
    """``[B, s * h, Lloc, D]`` (head chunk ``j`` = ``h`` heads for rank ``j``) -> ``[B, h, s * Lloc, D]``: this rank's
    heads over the whole sequence, positions in rank order."""
    b, heads, lloc, d = qkv.shape
    chunks = qkv.view(b, s, heads // s, lloc, d).transpose(0, 1)  # [s, B, h, Lloc, D]
    got = exchange(chunks, comm)  # got[i] = rank i's positions of my heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, heads // s, s * lloc, d)


def heads_to_seq(out: torch.Tensor, s: int, comm: Comm) -> torch.Tensor:
    """``[B, L, h, D]`` (this rank's ``h`` heads, all positions) -> ``[B, L / s, s * h, D]`` (this rank's positions,
    all heads in rank order)."""
    b, length, h, d = out.shape
    chunks = out.view(b, s, length // s, h, d).transpose(0, 1)  # chunk i = positions of rank i
    got = exchange(chunks, comm)  # got[i] = my positions of rank i's heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, length // s, s * h, d)


class _CoreView:
    """The attention module as the core kernel sees it after the exchange: ``num_key_value_groups`` is that of the
    local heads (1 when kv heads were repeated); every other attribute is the module's own. Read-only."""

    def __init__(self, module: nn.Module, groups: int) -> None:
        self._module = module
        self.num_key_value_groups = groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def causal_mask(length: int, dtype: torch.dtype, device: torch.device, additive: bool) -> torch.Tensor:
    """``[1, 1, L, L]`` causal mask over global positions: additive (0 / dtype min) or boolean (True = attend)."""
    allowed = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    if not additive:
        return allowed[None, None]
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[None, None]


def core_mask(
    given: torch.Tensor | None, length: int, dtype: torch.dtype, device: torch.device, additive: bool
) -> torch.Tensor:
    """The mask the core sees over a sequence of ``length`` keys: the causal mask when ``given`` is None, else
    ``given`` (``[B or 1, 1, L, L]`` over the *whole* row, queries and keys: e.g. a packed row's block-causal mask,
    identical on every rank of the group) as the core wants it: additive in ``dtype`` (0 = attend) or boolean.
    A 4D mask over the local slice's queries (the model's own, which this module cannot use) is a ``ValueError``."""
    if given is None:
        return causal_mask(length, dtype, device, additive)
    if given.ndim != 4 or tuple(given.shape[-2:]) != (length, length):
        raise ValueError(
            f"the attention mask under sequence parallelism must be 4D [batch, 1, {length}, {length}] over the whole "
            f"(padded) row, identical on every rank of the group; got shape {tuple(given.shape)} "
            "(SequenceParallel.shard_packed builds it for packed rows)"
        )
    if given.dtype == torch.bool:
        if not additive:
            return given
        zero = torch.zeros((), dtype=dtype, device=given.device)
        return torch.where(given, zero, torch.finfo(dtype).min)
    return given.to(dtype)


class UlyssesAttention:
    """An attention function for transformers' ``AttentionInterface``: exchange, core on the full sequence, exchange.

    ``core`` is the model's own kernel with HF's signature ``core(module, q, k, v, mask, scaling=..., dropout=...,
    **kwargs) -> (out [B, L, h, D], weights)``; ``additive_mask`` says whether it wants an additive float mask
    (eager) or a boolean one (SDPA). A 4D mask the model passes through (a packed row's block-causal mask over the
    whole row, :func:`core_mask`) replaces the causal one; without it the core is causal over the whole row.
    ``local_in_eval``: a module in eval mode attends over its own (whole, unsplit)
    sequence without any exchange (DeepSpeed's ``disable_in_eval``). Holds no tensors between calls."""

    def __init__(self, comm: Comm, core: CoreAttention, additive_mask: bool, local_in_eval: bool = False) -> None:
        self.comm = comm
        self.size = comm.world_size
        self.core = core
        self.additive_mask = additive_mask
        self.local_in_eval = local_in_eval

    def __call__(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        """``query [B, H, Lloc, D]``, ``key``/``value [B, H_kv, Lloc, D]`` -> ``([B, Lloc, H, D], None)``. The model's
        own mask is never built (:func:`~hybridzero.runtime.sequence_parallel.SequenceParallel.attach` registers none):
        ``attention_mask`` is None (causal over the full sequence) or a 4D full-row mask given by the caller."""
        s = self.size
        b, heads, lloc, d = query.shape
        kv_heads = key.shape[1]
        if self.local_in_eval and not module.training:
            mask = core_mask(attention_mask, lloc, query.dtype, query.device, self.additive_mask)
            kwargs.pop("position_ids", None)
            out, _ = self.core(_CoreView(module, heads // kv_heads), query, key, value, mask, **kwargs)
            return out, None
        if kv_heads % s:  # GQA with fewer kv heads than ranks: every query head gets its own copy of its kv head
            key = key.repeat_interleave(heads // kv_heads, dim=1)
            value = value.repeat_interleave(heads // kv_heads, dim=1)
            kv_heads = heads
        qkv = torch.cat(
            [
                query.view(b, s, heads // s, lloc, d),
                key.view(b, s, kv_heads // s, lloc, d),
                value.view(b, s, kv_heads // s, lloc, d),
            ],
            dim=2,
        ).view(b, -1, lloc, d)
        full = seq_to_heads(qkv, s, self.comm)  # [B, (H + 2 H_kv) / s, L, D]
        q, k, v = full.split([heads // s, kv_heads // s, kv_heads // s], dim=1)
        mask = core_mask(attention_mask, s * lloc, q.dtype, q.device, self.additive_mask)
        core_module = _CoreView(module, heads // kv_heads)
        kwargs.pop("position_ids", None)  # local positions: meaningless (and unused) on the full sequence
        out, _ = self.core(core_module, q, k, v, mask, **kwargs)
        return heads_to_seq(out, s, self.comm), None

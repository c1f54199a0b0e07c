"""Tensor-parallel building blocks for generation: slicing math (pure) and the two parallel linear layers.

Megatron's split of a transformer block over the ``t`` ranks of a tensor-parallel group, rank ``r``:

* column-parallel (q/k/v, MLP up/gate): ``W [out, in]`` keeps rows ``[r * out/t, (r+1) * out/t)`` (whole heads or
  intermediate units, in order) and the same part of the bias; the output holds this rank's heads / units and no
  communication is needed. A fused projection (GPT-2's ``c_attn`` = ``[q | k | v]``) is split per chunk.
* row-parallel (attention output, MLP down): ``W [out, in]`` keeps columns ``[r * in/t, (r+1) * in/t)``; each rank
  forms a partial product from its part of the input, one all-reduce (SUM, over the group's :class:`Comm`, so the
  ledger counts it) completes it, then the whole bias is added once.

Invariant: the parallel layers own copies (never views into a gathered buffer), so releasing the gather group after
slicing cannot change them; they hold no ``nn.Parameter`` (non-persistent buffers), so nothing the optimizer,
checkpoints or the ZeRO hooks see changes while they are swapped in.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybridzero.comm.collectives import Comm


def column_rows(out_features: int, rank: int, tp: int, chunks: int = 1) -> torch.Tensor:
    """Row indices of ``W [out, in]`` rank ``rank`` of ``tp`` keeps in a column split (pure): every one of the
    ``chunks`` equal parts of ``out`` (1, or 3 for a fused q|k|v) contributes its ``rank``-th ``1/tp``."""
    part = out_features // chunks
    size = part // tp
    return torch.cat([torch.arange(c * part + rank * size, c * part + (rank + 1) * size) for c in range(chunks)])


def column_slice(
    weight: torch.Tensor, bias: torch.Tensor | None, rank: int, tp: int, chunks: int = 1
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Copies of this rank's rows of ``weight [out, in]`` and of ``bias [out]`` (pure)."""
    rows = column_rows(weight.shape[0], rank, tp, chunks).to(weight.device)
    return weight.index_select(0, rows).contiguous(), None if bias is None else bias.index_select(0, rows).clone()


def row_slice(weight: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """A copy of this rank's columns of ``weight [out, in]`` (pure)."""
    size = weight.shape[1] // tp
    return weight[:, rank * size : (rank + 1) * size].contiguous()


class ColumnParallelLinear(nn.Module):
    """``x [..., in] -> [..., out/t]``: this rank's heads or units of a linear layer; no communication."""

    weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Local part of ``x @ W.T + b``."""
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``x [..., in/t] -> [..., out]``: partial product, all-reduced over the tensor-parallel group, plus the bias."""

    weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, comm: Comm) -> None:
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``sum over ranks (x_r @ W_r.T) + b`` -- every rank of the group gets the same bytes."""
        out = F.linear(x, self.weight).contiguous()
        self.comm.all_reduce(out, phase="generate")
        return out if self.bias is None else out + self.bias


def linear_weight(module: nn.Module, transposed: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(W [out, in], bias)`` of a linear layer (``nn.Linear``, LoRA's merged ``LoRALinear``, or GPT-2's ``Conv1D``
    whose weight is stored ``[in, out]`` when ``transposed``)."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise TypeError(f"tensor-parallel generation cannot split {type(module).__name__}: it has no 2-D weight")
    bias = getattr(module, "bias", None)
    return (weight.t() if transposed else weight), bias if isinstance(bias, torch.Tensor) else None


def local_clone(
    module: nn.Module,
    children: Mapping[str, nn.Module] | None = None,
    attrs: Mapping[str, Any] | None = None,
    copy_params: bool = False,
) -> nn.Module:
    """A new module of ``module``'s class sharing its plain attributes and buffers (so its own ``forward`` runs
    unchanged), with ``children`` replacing some submodules and ``attrs`` (e.g. a local head count) set on the copy
    only. Direct parameters become buffers holding copies when ``copy_params`` (layer norms, whose gather group is
    released during generation); otherwise a module with direct parameters is refused. The original is untouched
    and no hook is carried over."""
    clone = type(module).__new__(type(module))
    nn.Module.__init__(clone)
    for key, value in vars(module).items():
        if key not in vars(clone):
            clone.__dict__[key] = value
    clone.training = module.training
    for name, child in module.named_children():
        clone.add_module(name, (children or {}).get(name, child))
    for name, buf in module.named_buffers(recurse=False):  # shared; the clone lives inside generation, never saved
        clone.register_buffer(name, buf, persistent=False)
    for name, param in module.named_parameters(recurse=False):
        if not copy_params:
            raise TypeError(
                f"tensor-parallel generation cannot split {type(module).__name__}: it holds parameter {name!r} "
                "outside its projections"
            )
        clone.register_buffer(name, param.detach().clone(), persistent=False)
    for key, value in (attrs or {}).items():
        setattr(clone, key, value)
    return clone

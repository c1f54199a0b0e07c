"""The optimizer side of ZeRO: a torch optimizer over flat fp32 master shards.

Each gather group orders its parameters by optimizer param-group index (frozen ones last), so the elements of
param group ``k`` inside a gather group form one contiguous flat range; intersected with this rank's shard that is
one contiguous view of the group's master shard. The torch optimizer steps those views (leaf ``nn.Parameter``s
sharing the master storage) with ``.grad`` bound to the matching views of the fp32 gradient shard.

Invariants: element-wise optimizers (Adam, AdamW, SGD) give exactly the update the unsharded optimizer would give
to the same elements; padding is never part of any view; the grad views are re-bound before every step, so a user
calling ``optimizer.zero_grad(set_to_none=True)`` cannot detach them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from hybridzero.comm.collectives import Comm
from hybridzero.optim.clip import clip_coefficient
from hybridzero.zero.groups import ShardedGroup
from hybridzero.zero.offload import move

FROZEN = 1 << 30  # sort key for parameters that no optimizer group holds


def optimizer_groups(
    module: nn.Module, client: torch.optim.Optimizer | None, model_parameters: Iterable[Any] | None
) -> tuple[dict[str, int], list[dict[str, Any]]]:
    """Map parameter name (first name in ``named_parameters()``) to optimizer group index, and return each
    group's hyperparameter overrides. Names, not object ids, so the map survives meta-device materialization.

    Source, in order: the client optimizer's param groups, ``model_parameters`` (tensors or torch-style group
    dicts), else one group of every parameter that requires grad.
    """
    if client is not None:
        raw = [dict(g) for g in client.param_groups]
    elif model_parameters is not None:
        items = list(model_parameters)
        raw = [dict(g) for g in items] if items and isinstance(items[0], dict) else [{"params": items}]
    else:
        raw = [{"params": [p for p in module.parameters() if p.requires_grad]}]
    index_of: dict[int, int] = {}
    overrides: list[dict[str, Any]] = []
    for k, group in enumerate(raw):
        for p in group["params"]:
            if p.requires_grad:
                index_of.setdefault(id(p), k)
        overrides.append({key: v for key, v in group.items() if key != "params"})
    return {name: index_of[id(p)] for name, p in module.named_parameters() if id(p) in index_of}, overrides


Views = list[list[tuple[torch.Tensor, torch.Tensor]]]  # per optimizer group: (master view, grad view) pairs


def order_for_optimizer(
    params: Sequence[tuple[str, nn.Parameter]], index_of: dict[str, int]
) -> list[tuple[str, nn.Parameter]]:
    """Stable order of a gather group's parameters by optimizer group (frozen / unoptimized last)."""
    return sorted(params, key=lambda item: index_of.get(item[0], FROZEN))


def shard_views(groups: Sequence[ShardedGroup], index_of: dict[str, int], n_opt_groups: int) -> Views:
    """For each optimizer group: (master view, grad view) pairs of this rank's shards, in gather-group order."""
    out: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(n_opt_groups)]
    for group in groups:
        ranges: dict[int, tuple[int, int]] = {}
        for slot in group.slots:
            k = index_of.get(slot.spec.name)
            if k is None:
                continue
            lo, hi = ranges.get(k, (slot.spec.offset, slot.spec.end))
            ranges[k] = (min(lo, slot.spec.offset), max(hi, slot.spec.end))
        for k, flat_range in ranges.items():
            local = group.local_range(flat_range)
            if local is not None:
                out[k].append((group.master[local[0] : local[1]], group.opt_grad[local[0] : local[1]]))
    return out


def split_views(views: Views, max_numel: int) -> Views:
    """Each (master view, grad view) pair cut into consecutive pieces of at most ``max_numel`` elements (NVMe
    offload: ``sub_group_size`` bounds what one streamed chunk holds). Element-wise optimizers step the pieces
    exactly as the whole view; the pieces still cover the same elements, in order."""
    return [
        [(m[lo : lo + max_numel], g[lo : lo + max_numel]) for m, g in group for lo in range(0, m.numel(), max_numel)]
        for group in views
    ]


def make_leaf_params(views: Views) -> list[list[tuple[nn.Parameter, torch.Tensor]]]:
    """Leaf parameters sharing each master view's storage, paired with their gradient views."""
    return [[(nn.Parameter(master, requires_grad=True), grad) for master, grad in group] for group in views]


def bind_grads(leaves: list[list[tuple[nn.Parameter, torch.Tensor]]]) -> None:
    """Point every leaf's ``.grad`` at its gradient-shard view."""
    for group in leaves:
        for param, grad in group:
            param.grad = grad


_SQUARE_CHUNK = 1 << 16  # elements per fp64 chunk: stays in cache; 10x faster than one whole-shard fp64 copy


def square_sum_fp64(x: torch.Tensor) -> torch.Tensor:
    """``sum(x**2)`` accumulated in fp64, chunk by chunk (never a whole fp64 copy of ``x``)."""
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    for chunk in x.reshape(-1).split(_SQUARE_CHUNK):
        total += chunk.double().square().sum()
    return total


def global_grad_norm(groups: Sequence[ShardedGroup], comm: Comm) -> torch.Tensor:
    """L2 norm (fp32) of the full gradient: squares summed in fp64 over shards and ranks, replicated groups once.

    fp64 accumulation makes the result independent of how the elements are split over ranks, up to rounding far
    below fp32 resolution; :func:`reference_grad_norm` computes the same quantity on unsharded gradients.
    """
    total = torch.zeros((), dtype=torch.float64, device=groups[0].device if groups else None)
    for group in groups:
        if group.replicated and comm.rank != 0:
            continue
        total += square_sum_fp64(group.grad_shard)
    comm.all_reduce(total, phase="step")
    return total.sqrt().float()


def reference_grad_norm(grads: Iterable[torch.Tensor]) -> torch.Tensor:
    """The quantity :func:`global_grad_norm` computes, for whole (unsharded) gradients in one process."""
    total = torch.zeros((), dtype=torch.float64)
    for g in grads:
        total += square_sum_fp64(g)
    return total.sqrt().float()


def clip_grad_shards(groups: Sequence[ShardedGroup], comm: Comm, max_norm: float) -> torch.Tensor:
    """Scale every gradient shard so the global norm is at most ``max_norm``; returns the norm before clipping."""
    norm = global_grad_norm(groups, comm)
    coef = clip_coefficient(norm, max_norm)
    for group in groups:
        group.grad_shard.mul_(move(coef, group.grad_shard.device))  # the shard may be offloaded to the host
    return norm

"""Gradient-norm clipping math: the clip coefficient, and a sum of squares over local gradient pieces.

A sharded engine clips in three steps:

1. each rank sums the squares of the gradient pieces it owns;
2. the local sums are all-reduced (SUM) across the ranks that partition the gradients,
   and ``total_norm = sqrt(global_sum)``;
3. every rank scales its pieces by :func:`clip_coefficient` ``(total_norm, max_norm)``.

The engine does steps 1-2 in :func:`hybridzero.optim.sharded.global_grad_norm`: squares accumulated in fp64, in
cache-sized chunks (:func:`~hybridzero.optim.sharded.square_sum_fp64`), so the norm does not depend on how the
elements are split over ranks; it uses only :func:`clip_coefficient` from this module. :func:`sum_of_squares` is
the fp32 variant below, kept as a tested helper (the engine does not call it).

Invariant for step 1: every gradient element is counted exactly once across all ranks.
Pieces that are *replicated* (identical on several ranks, e.g. parameters that are not
partitioned, or the same shard held by every member of a replica group) must be included
by only one of those ranks (or divided by the replication factor), otherwise the norm is
overestimated and gradients are clipped too hard.

Numerics of :func:`sum_of_squares`: the per-tensor norm is ``torch.linalg.vector_norm(t, dtype=float32)`` (low
precision inputs are upcast before reduction), squared and accumulated in fp32. The result
therefore matches torch's own total norm (a norm of per-tensor norms) to fp32 rounding, not
bitwise. :func:`clip_coefficient` is bitwise identical to the coefficient
``torch.nn.utils.clip_grad_norm_`` derives from a given total norm.  Non-finite gradients
propagate (``inf``/``nan`` sums give a ``0``/``nan`` coefficient), as in torch with
``error_if_nonfinite=False``; callers decide whether to skip the step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["TORCH_CLIP_EPS", "clip_coefficient", "sum_of_squares"]

TORCH_CLIP_EPS: float = 1e-6


def sum_of_squares(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """Sum of squared L2 norms of ``tensors``, as a 0-dim fp32 tensor.

    The result lives on the first tensor's device (later tensors' partial sums are moved
    there); an empty iterable gives ``tensor(0.0)`` on the CPU.  Empty tensors contribute 0.
    The inputs are not modified and no autograd graph is recorded.
    """
    total: torch.Tensor | None = None
    with torch.no_grad():
        for tensor in tensors:
            norm = torch.linalg.vector_norm(tensor.detach(), 2, dtype=torch.float32)
            square = norm * norm
            if total is None:
                total = square
            else:
                total = total + square.to(total.device)
    if total is None:
        return torch.zeros((), dtype=torch.float32)
    return total


def clip_coefficient(total_norm: torch.Tensor, max_norm: float, eps: float = TORCH_CLIP_EPS) -> torch.Tensor:
    """Gradient scale ``min(1, max_norm / (total_norm + eps))`` as a tensor.

    Uses the same operation sequence as ``torch.nn.utils.clip_grad_norm_`` (a Python float
    divided by the tensor, then ``torch.clamp(max=1.0)``), so for the same ``total_norm`` the
    coefficient, and hence the scaled gradients, are bitwise identical to torch's.  The result
    has ``total_norm``'s dtype and device; multiplying by it when it is 1.0 is a no-op, which
    avoids a host sync on ``coefficient < 1``.

    Raises:
        ValueError: ``max_norm`` is not positive or ``eps`` is negative.
    """
    max_norm = float(max_norm)
    if not max_norm > 0.0:
        raise ValueError(f"max_norm must be > 0, got {max_norm!r}")
    if eps < 0.0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    coefficient = max_norm / (total_norm + eps)
    return torch.clamp(coefficient, max=1.0)

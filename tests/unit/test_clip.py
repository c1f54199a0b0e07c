"""Tests for hybridzero.optim.clip: the clip coefficient against ``torch.nn.utils.clip_grad_norm_`` (bitwise), the
fp32 sum of squares (low precision, empty, sharded with replicated tensors counted once), non-finite norms and errors.
"""

from __future__ import annotations

import pytest
import torch

from hybridzero.optim.clip import TORCH_CLIP_EPS, clip_coefficient, sum_of_squares
from tests.unit.test_optim import _assert_bitwise


# --- clip
def _with_grads(seed: int, scale: float) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in [(3, 4), (7,), (2, 2, 2)]]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * scale
    return params


@pytest.mark.parametrize(("scale", "max_norm"), [(10.0, 1.0), (0.01, 1.0), (1.0, 0.5)])
def test_clip_coefficient_matches_clip_grad_norm(scale: float, max_norm: float) -> None:
    ours = _with_grads(0, scale)
    ref = _with_grads(0, scale)
    total = torch.nn.utils.clip_grad_norm_(ref, max_norm)
    coefficient = clip_coefficient(total, max_norm)
    assert coefficient.item() <= 1.0
    for p in ours:
        p.grad.mul_(coefficient)
    _assert_bitwise([p.grad for p in ours], [p.grad for p in ref])
    expected = torch.clamp(max_norm / (total + TORCH_CLIP_EPS), max=1.0)
    assert torch.equal(coefficient, expected)


def test_sum_of_squares_matches_total_norm() -> None:
    params = _with_grads(1, 3.0)
    grads = [p.grad for p in params]
    ours = sum_of_squares(grads)
    assert ours.dtype == torch.float32 and ours.dim() == 0
    reference = torch.nn.utils.get_total_norm(grads)
    torch.testing.assert_close(ours.sqrt(), reference, rtol=1e-6, atol=0.0)
    direct = sum(float(g.double().pow(2).sum()) for g in grads)
    assert abs(ours.item() - direct) <= 1e-5 * direct


def test_sum_of_squares_low_precision_is_fp32() -> None:
    grads = [torch.full((1000,), 300.0, dtype=torch.bfloat16)]
    ours = sum_of_squares(grads)
    assert ours.dtype == torch.float32
    assert ours.item() == pytest.approx(1000 * 300.0**2, rel=1e-6)


def test_sum_of_squares_empty() -> None:
    assert torch.equal(sum_of_squares([]), torch.tensor(0.0))
    assert sum_of_squares([torch.zeros(0)]).item() == 0.0


def test_sharded_sum_of_squares_counts_replicated_once() -> None:
    gen = torch.Generator().manual_seed(5)
    sharded = torch.randn(30, generator=gen)
    replicated = torch.randn(4, generator=gen)
    full = sum_of_squares([sharded, replicated])
    shards = sharded.chunk(3)
    # rank 0 also owns the replicated tensor; ranks 1 and 2 skip it.
    local = [sum_of_squares([shards[0], replicated]), sum_of_squares([shards[1]]), sum_of_squares([shards[2]])]
    torch.testing.assert_close(sum(local), full, rtol=1e-6, atol=0.0)
    double_counted = sum(sum_of_squares([s, replicated]) for s in shards)
    assert double_counted > full


def test_clip_coefficient_nonfinite_and_errors() -> None:
    assert clip_coefficient(torch.tensor(float("inf")), 1.0).item() == 0.0
    assert torch.isnan(clip_coefficient(torch.tensor(float("nan")), 1.0))
    with pytest.raises(ValueError, match="max_norm must be > 0, got 0.0"):
        clip_coefficient(torch.tensor(1.0), 0.0)
    with pytest.raises(ValueError, match="eps must be >= 0, got -1.0"):
        clip_coefficient(torch.tensor(1.0), 1.0, eps=-1.0)

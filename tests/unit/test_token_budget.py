"""``token_budget_chunks`` (pure) and the ``--max_tokens_per_batch`` settings errors."""

from __future__ import annotations

import random

import pytest

from hybridzero.packing import token_budget_chunks
from hybridzero.rlhf.settings import GRPOSettings, PPOSettings, SFTSettings


@pytest.mark.parametrize("seed", range(20))
def test_chunks_cover_every_sequence_once_within_the_budget(seed: int) -> None:
    rng = random.Random(seed)
    budget = rng.randint(8, 40)
    lengths = [rng.randint(1, budget) for _ in range(rng.randint(1, 30))]
    chunks = token_budget_chunks(lengths, budget)
    flat = [i for c in chunks for i in c]
    assert sorted(flat) == list(range(len(lengths)))  # every sequence in exactly one chunk
    assert all(c and sum(lengths[i] for i in c) <= budget for c in chunks)  # no chunk over the budget
    assert all(c == sorted(c) for c in chunks)
    assert token_budget_chunks(list(lengths), budget) == chunks  # deterministic
    # first-fit-decreasing never leaves two chunks that would fit together
    totals = sorted(sum(lengths[i] for i in c) for c in chunks)
    assert len(totals) < 2 or totals[0] + totals[1] > budget


def test_chunks_first_fit_decreasing_example() -> None:
    assert token_budget_chunks([9, 2, 6, 4, 7], 12) == [[0, 1], [3, 4], [2]]
    assert token_budget_chunks([3, 3, 3], 9) == [[0, 1, 2]]
    assert token_budget_chunks([], 4) == []


def test_sequence_longer_than_the_budget_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match=r"max_tokens_per_batch 8 is below a sequence of 11 tokens.*>= 11"):
        token_budget_chunks([3, 11, 2], 8)
    with pytest.raises(ValueError, match=r"below a pair \(chosen \+ rejected\) of 9 tokens"):
        token_budget_chunks([9], 8, "pair (chosen + rejected)")
    with pytest.raises(ValueError, match="max_tokens_per_batch must be >= 1"):
        token_budget_chunks([1], 0)


@pytest.mark.parametrize("cls", [SFTSettings, PPOSettings, GRPOSettings])
def test_budget_needs_packing(cls: type) -> None:
    with pytest.raises(ValueError, match=r"max_tokens_per_batch=64 needs packing_samples"):
        cls(max_tokens_per_batch=64)
    assert cls(packing_samples=True, max_tokens_per_batch=64).max_tokens_per_batch == 64
    assert cls().max_tokens_per_batch is None
    with pytest.raises(ValueError, match="max_tokens_per_batch"):
        cls(packing_samples=True, max_tokens_per_batch=0)

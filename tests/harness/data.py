"""Deterministic synthetic token data for multi-rank training tests."""

from __future__ import annotations

import torch

__all__ = ["make_token_batches"]


def make_token_batches(
    seed: int,
    *,
    steps: int,
    accumulation: int,
    world_size: int,
    micro_batch: int,
    seq_len: int,
    vocab_size: int,
) -> torch.Tensor:
    """Uniform random token ids, laid out ``[steps, accumulation, world_size, micro_batch, seq_len]``.

    Rank ``r`` feeds micro-batch ``m`` of optimizer step ``s`` with ``batches[s, m, r]``, so a
    single-process reference sees step ``s`` as ``batches[s].reshape(-1, seq_len)`` (all
    micro-batches of all ranks).  The tensor is int64 with values in ``[0, vocab_size)`` and
    depends only on the arguments: it uses a private ``torch.Generator``, never the global RNG.
    """
    shape = (steps, accumulation, world_size, micro_batch, seq_len)
    if min(shape) < 1 or vocab_size < 1:
        raise ValueError(f"all sizes must be positive, got shape={shape} vocab_size={vocab_size}")
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    return torch.randint(0, vocab_size, shape, generator=generator, dtype=torch.int64)

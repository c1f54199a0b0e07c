"""Truncated importance sampling (TIS) between the rollout engine's sampler and the trainer (pure functions).

A rollout engine (vLLM) samples with its own kernels, so the probability it gave a token, ``q``, differs slightly
from the trainer's ``p_old`` for the same weights. The policy-gradient term of each answer token is then weighted
by ``w = min(p_old / q, cap) = min(exp(logp_old - logq), cap)`` (Yao et al., "Your efficient RL framework secretly
brings you off-policy RL training", 2025; TRL's ``vllm_importance_sampling_correction`` / ``_cap``). The weight is a
constant (no gradient); the KL term is not weighted. ``w = 1`` where the two agree, and outside the answer tokens.
"""

from __future__ import annotations

import torch

__all__ = ["truncated_is_weights"]


def truncated_is_weights(
    trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor, cap: float
) -> torch.Tensor:
    """``[B, T]`` fp32 weights ``min(exp(trainer - sampler), cap)`` on ``mask``, 1 elsewhere; ``cap > 0``.

    ``trainer_logprobs`` / ``sampler_logprobs``: per-token log-probabilities of the sampled tokens, same shape."""
    if cap <= 0:
        raise ValueError(f"importance sampling cap = {cap} must be > 0")
    if trainer_logprobs.shape != sampler_logprobs.shape or trainer_logprobs.shape != mask.shape:
        raise ValueError(
            f"shapes differ: trainer {tuple(trainer_logprobs.shape)}, sampler {tuple(sampler_logprobs.shape)}, "
            f"mask {tuple(mask.shape)}"
        )
    ratio = torch.exp(trainer_logprobs.double() - sampler_logprobs.double()).clamp(max=cap).float()
    return torch.where(mask.bool(), ratio, torch.ones_like(ratio))

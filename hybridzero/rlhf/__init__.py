"""RLHF pipeline pieces: typed experience records and the pure PPO / GRPO math."""
from __future__ import annotations

from hybridzero.rlhf.algorithms import (
    GRPOHyperParams,
    PolicyLossStats,
    PPOHyperParams,
    clipped_value_loss,
    gae,
    gather_logprobs,
    grpo_advantages,
    grpo_loss,
    kl_penalized_rewards,
    last_action_index,
    masked_mean,
    masked_var,
    masked_whiten,
    ppo_policy_loss,
)
from hybridzero.rlhf.experience import Experience

__all__ = [
    "Experience",
    "GRPOHyperParams",
    "PPOHyperParams",
    "PolicyLossStats",
    "clipped_value_loss",
    "gae",
    "gather_logprobs",
    "grpo_advantages",
    "grpo_loss",
    "kl_penalized_rewards",
    "last_action_index",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "ppo_policy_loss",
]

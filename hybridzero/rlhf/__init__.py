"""The RLHF pipeline: SFT (:func:`train_sft`), reward model (:func:`train_reward`), PPO / GRPO
(:func:`train_step3`) with their typed settings, the typed experience record and the pure PPO / GRPO math.

The trainers and settings load lazily (they pull in transformers); the math and the record import eagerly.
"""
from __future__ import annotations

import importlib
from typing import Any

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

_LAZY = {
    "train_sft": "hybridzero.rlhf.sft",
    "train_reward": "hybridzero.rlhf.reward",
    "train_step3": "hybridzero.rlhf.step3",
    "run_demo": "hybridzero.rlhf.demo",
    "SFTSettings": "hybridzero.rlhf.settings",
    "RewardSettings": "hybridzero.rlhf.settings",
    "PPOSettings": "hybridzero.rlhf.settings",
    "GRPOSettings": "hybridzero.rlhf.settings",
    "ValueHeadModel": "hybridzero.rlhf.models",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hybridzero.rlhf' has no attribute {name!r}")

__all__ = [
    "Experience",
    "GRPOHyperParams",
    "GRPOSettings",
    "PPOHyperParams",
    "PPOSettings",
    "PolicyLossStats",
    "RewardSettings",
    "SFTSettings",
    "ValueHeadModel",
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
    "run_demo",
    "train_reward",
    "train_sft",
    "train_step3",
]

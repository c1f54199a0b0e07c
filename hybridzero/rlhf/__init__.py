"""The RLHF pipeline: SFT (:func:`train_sft`), reward model (:func:`train_reward`), PPO / GRPO (:func:`train_step3`)
with their typed settings, the typed experience record and the pure PPO / GRPO math.

Layout (concepts, each module readable top to bottom):

* ``settings`` — every knob, default and bound once; ``cli`` — the commands, flags generated from the settings;
* ``data/`` — records and sources, tokenization, dealing batches to ranks, the ptx stream;
* ``models`` — value-head model, tokenizer and model loading, HF-directory savers; ``engines`` — DeepSpeed
  configs and the engines of each role;
* ``math`` — pure losses, GAE, whitening, KL; ``experience`` — the typed record; ``rollout`` — generation and
  scoring into experience;
* ``sft``, ``reward`` (steps 1 and 2, sharing ``supervised``'s loop); ``ppo``, ``grpo`` — one iteration of each
  algorithm; ``step3`` — what both share; ``trainer`` — step 3's outer loop; ``checkpoints`` — multi-role save
  and resume;
* RL with verifiable rewards: ``rewards`` (reward functions: loading, forked calls with a deadline, combining),
  ``reward_set`` (a run's sources and the agreement protocol), ``grpo_rollout`` (scored groups, DAPO's refill),
  ``grpo_math`` (the GRPO family's pure math), ``stops`` (stop strings);
* ``report``, ``runlog``, ``plot`` — DeepSpeed-Chat's report, ``metrics.jsonl`` + TensorBoard, matplotlib PNGs;
* ``demo/`` — the shipped task and the README's demo.
"""

from __future__ import annotations

from hybridzero.rlhf.algorithms.ppo import (
    PolicyLossStats,
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
from hybridzero.rlhf.demo.run import run_demo
from hybridzero.rlhf.models import ValueHeadModel
from hybridzero.rlhf.rewards.functions import RewardError, load_reward_function
from hybridzero.rlhf.rollout.experience import Experience
from hybridzero.rlhf.settings import GRPOSettings, PPOSettings, RewardSettings, SFTSettings
from hybridzero.rlhf.steps.reward_model import train_reward
from hybridzero.rlhf.steps.rl.trainer import train_step3
from hybridzero.rlhf.steps.sft import train_sft

__all__ = [
    "Experience",
    "GRPOSettings",
    "PPOSettings",
    "PolicyLossStats",
    "RewardError",
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
    "load_reward_function",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "ppo_policy_loss",
    "run_demo",
    "train_reward",
    "train_sft",
    "train_step3",
]

"""The RLHF pipeline: SFT (:func:`train_sft`), reward model (:func:`train_reward`), PPO / GRPO (:func:`train_step3`)
with their typed settings, the typed experience record and the pure PPO / GRPO math.

Layout: one room per concept, imports pointing down this list (``tests/unit/test_rlhf_layers.py``):

* ``settings`` — every knob, default and bound once; ``algorithms/`` — the pure math (``ppo``: losses, GAE,
  whitening, KL; ``grpo``: the GRPO family); ``runlog/`` — ``metrics.jsonl`` + TensorBoard, DeepSpeed-Chat's
  report, matplotlib PNGs;
* ``data/`` — records and sources, tokenization, dealing batches to ranks, the ptx stream, the demo's task;
* ``lora``, ``models`` — value-head model, tokenizer and model loading, HF-directory savers; ``engines`` —
  DeepSpeed configs and the engines of each role;
* ``rewards/`` — reward functions (``functions``), their forked worker (``isolation``), a run's sources and the
  agreement protocol (``sources``);
* ``rollout/`` — generation and scoring into experience (``generate``), the typed record (``experience``), stop
  strings (``stops``);
* ``steps/`` — ``sft``, ``reward_model`` (steps 1 and 2, sharing ``supervised``'s loop) and ``rl/`` (step 3:
  ``trainer`` the outer loop, ``step3`` what both algorithms share, one iteration of ``ppo`` and of ``grpo``
  with ``grpo_rollout``'s scored groups, ``checkpoints``);
* ``demo/`` — the README's demos; ``cli`` — the commands, flags generated from the settings.
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

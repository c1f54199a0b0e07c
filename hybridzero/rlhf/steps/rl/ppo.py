"""PPO (DeepSpeed-Chat's step 3): one iteration, top to bottom — rollout, experience, targets, update, EMA.

1. **Rollout and experience.** For each of ``generation_batches`` batches: generate this rank's answers (hybrid
   engine or ZeRO-3 generation, per-sample seeds) and score them with the actor (old log-probs), the reference,
   the critic (values) and the reward model (:meth:`Step3.rollout`).
2. **Targets.** KL-penalised per-token rewards (``kl_ctl``, reward clipped to ``clip_reward_value``), then GAE
   (``gamma``, ``lambd``) over the answer tokens: advantages and returns.
3. **Update.** ``ppo_epochs`` passes over all of the iteration's experience in mini-batches of
   ``per_device_training_batch_size``: clipped policy loss on the actor and clipped value loss on the critic, both
   global token means, stepped together (:func:`~hybridzero.rlhf.steps.rl.step3.step_both`); then an unsupervised (ptx)
   actor step when a ptx dataset is given.
4. **EMA.** The EMA actor moves towards the actor (:meth:`Engine.ema_update_from`).

The math is :mod:`hybridzero.rlhf.algorithms.ppo` (pure); this module only sequences engine calls.
"""

from __future__ import annotations

import time

import torch

from hybridzero.rlhf.algorithms.ppo import clipped_value_loss, gae, kl_penalized_rewards, ppo_policy_loss
from hybridzero.rlhf.engines import Roles, global_sum
from hybridzero.rlhf.rollout.experience import Experience
from hybridzero.rlhf.rollout.generate import critic_values, sequence_logprobs
from hybridzero.rlhf.steps.rl.step3 import (
    Step3,
    UpdateStats,
    global_scale,
    mean_update_stats,
    ptx_update,
    slice_experience,
    step_both,
)

__all__ = ["compute_targets", "ppo_iteration", "ppo_update"]


def compute_targets(
    exp: Experience, *, kl_coef: float, clip_reward: float, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T-1]`` advantages and returns: KL-penalised per-token rewards, then GAE over the action tokens."""
    rewards = kl_penalized_rewards(
        exp.logprobs, exp.ref_logprobs, exp.rewards, exp.action_mask, kl_coef=kl_coef, clip_reward=clip_reward
    )
    return gae(rewards, exp.values, exp.action_mask, gamma=gamma, lam=lam)


def ppo_update(
    roles: Roles,
    exp: Experience,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    *,
    clip: float,
    clip_value: float,
    packed: bool = False,
) -> UpdateStats:
    """One PPO training step of the actor and the critic on one mini-batch of experience (``packed``: both
    forwards on packed rows)."""
    assert roles.critic is not None, "PPO needs a critic engine"
    mask = exp.action_mask
    n_tokens = float(mask.sum())
    logp = sequence_logprobs(roles.actor, exp.sequences, exp.attention_mask, packed)
    actor_loss, stats = ppo_policy_loss(logp, exp.logprobs, advantages, mask, clip=clip)
    scale = global_scale(roles.actor, n_tokens)
    roles.actor.backward(actor_loss * scale)
    values = critic_values(roles.critic, exp.sequences, exp.attention_mask, packed)
    critic_loss = clipped_value_loss(values, exp.values, returns, mask, clip=clip_value)
    roles.critic.backward(critic_loss * scale)
    skipped = step_both(roles.actor, roles.critic)
    sums = global_sum(
        roles.actor,
        [
            float(actor_loss.detach()) * n_tokens,
            float(critic_loss.detach()) * n_tokens,
            float(stats.clip_fraction) * n_tokens,
            float(stats.approx_kl) * n_tokens,
            n_tokens,
        ],
    )
    n = max(sums[4], 1.0)
    return UpdateStats(sums[0] / n, sums[1] / n, sums[2] / n, sums[3] / n, skipped)


def ppo_iteration(run: Step3, it: int) -> dict[str, float]:
    """Iteration ``it`` of PPO (module docstring, steps 1-4); returns the iteration's global metrics."""
    s, roles = run.s, run.roles
    t0 = time.perf_counter()
    batches, targets, gen_s = [], [], 0.0
    for b in range(s.generation_batches):  # 1. rollout and experience, 2. targets
        g0 = time.perf_counter()
        rb = run.rollout(it, b)
        gen_s += time.perf_counter() - g0
        batches.append(rb)
        adv, ret = compute_targets(
            rb.exp, kl_coef=s.kl_ctl, clip_reward=s.clip_reward_value, gamma=s.gamma, lam=s.lambd
        )
        if rb.is_weights is not None:  # truncated IS (vLLM): the policy term weighted per token, the critic's not
            adv = adv * rb.is_weights.to(adv.dtype)
        targets.append((adv, ret))
    t1 = time.perf_counter()
    stats, ptx_losses = [], []
    for _ in range(s.ppo_epochs):  # 3. update
        for rb, (advantages, returns) in zip(batches, targets):
            for lo, hi in run.minibatches(rb.exp):
                stats.append(
                    ppo_update(
                        roles,
                        slice_experience(rb.exp, lo, hi),
                        advantages[lo:hi],
                        returns[lo:hi],
                        clip=s.cliprange,
                        clip_value=s.cliprange_value,
                        packed=s.packing_samples,
                    )
                )
                if run.ptx is not None:
                    ptx_losses.append(ptx_update(roles.actor, run.ptx.next_batch(), s.unsup_coef))
    train_s = time.perf_counter() - t1
    if roles.ema is not None:  # 4. EMA
        roles.ema.ema_update_from(roles.actor, s.ema_beta)
    metrics = mean_update_stats(stats, ptx_losses if run.ptx is not None else None, with_critic=True)
    metrics.update(run.rollout_metrics(batches, with_values=True))
    timing = {"e2e_s": time.perf_counter() - t0, "generation_s": gen_s, "training_s": train_s}
    return {**metrics, **timing, "actor_lr": roles.actor.get_lr()[0]}

"""GRPO: one iteration, top to bottom — rollout, experience, group advantages, update, EMA. No critic.

1. **Rollout and experience.** ``group_size`` samples of every prompt (contiguous rows, each with its own sampling
   seed), scored by the actor (old log-probs), the reference and the reward model (:meth:`Step3.rollout`).
2. **Targets.** Group-relative advantages of the reward model's scores (one per sample).
3. **Update.** ``ppo_epochs`` passes over all of the iteration's experience in mini-batches: the GRPO loss
   (clipped ratio with the sample's advantage, plus ``grpo_kl_coef`` x the k3 KL to the reference), a global
   per-sequence mean; then an unsupervised (ptx) actor step when a ptx dataset is given.
4. **EMA.** The EMA actor moves towards the actor (:meth:`Engine.ema_update_from`).

Every prompt's group lives on one rank and in one training mini-batch (checked by the settings).
"""

from __future__ import annotations

import time

import torch

from hybridzero.rlhf.engines import Roles, global_sum
from hybridzero.rlhf.experience import Experience
from hybridzero.rlhf.math import grpo_advantages, grpo_loss
from hybridzero.rlhf.rollout import sequence_logprobs
from hybridzero.rlhf.settings import GRPOSettings
from hybridzero.rlhf.step3 import (
    Step3,
    UpdateStats,
    global_scale,
    mean_update_stats,
    ptx_update,
    slice_experience,
    step_both,
)

__all__ = ["grpo_iteration", "grpo_update"]


def grpo_update(roles: Roles, exp: Experience, advantages: torch.Tensor, *, clip: float, kl_coef: float) -> UpdateStats:
    """One GRPO training step of the actor (group advantages ``[B]``; KL to the reference in the loss)."""
    logp = sequence_logprobs(roles.actor, exp.sequences, exp.attention_mask)
    loss, stats = grpo_loss(
        logp, exp.logprobs, exp.ref_logprobs, advantages, exp.action_mask, clip=clip, kl_coef=kl_coef
    )
    n_seq = float(exp.batch_size)
    roles.actor.backward(loss * global_scale(roles.actor, n_seq))
    skipped = step_both(roles.actor, None)
    n_tokens = float(exp.action_mask.sum())
    sums = global_sum(
        roles.actor,
        [
            float(loss.detach()) * n_seq,
            n_seq,
            float(stats.clip_fraction) * n_tokens,
            float(stats.approx_kl) * n_tokens,
            n_tokens,
        ],
    )
    return UpdateStats(
        sums[0] / max(sums[1], 1.0), 0.0, sums[2] / max(sums[4], 1.0), sums[3] / max(sums[4], 1.0), skipped
    )


def grpo_iteration(run: Step3, it: int) -> dict[str, float]:
    """Iteration ``it`` of GRPO (module docstring, steps 1-4); returns the iteration's global metrics."""
    s, roles = run.s, run.roles
    assert isinstance(s, GRPOSettings)
    t0 = time.perf_counter()
    batches, advantages, gen_s = [], [], 0.0
    for b in range(s.generation_batches):  # 1. rollout and experience, 2. group advantages
        g0 = time.perf_counter()
        rb = run.rollout(it, b)
        gen_s += time.perf_counter() - g0
        batches.append(rb)
        advantages.append(grpo_advantages(rb.exp.rewards, s.group_size))
    t1 = time.perf_counter()
    stats, ptx_losses = [], []
    for _ in range(s.ppo_epochs):  # 3. update
        for rb, adv in zip(batches, advantages):
            for lo, hi in run.minibatches(rb.exp):
                stats.append(
                    grpo_update(
                        roles, slice_experience(rb.exp, lo, hi), adv[lo:hi], clip=s.cliprange, kl_coef=s.grpo_kl_coef
                    )
                )
                if run.ptx is not None:
                    ptx_losses.append(ptx_update(roles.actor, run.ptx.next_batch(), s.unsup_coef))
    train_s = time.perf_counter() - t1
    if roles.ema is not None:  # 4. EMA
        roles.ema.ema_update_from(roles.actor, s.ema_beta)
    metrics = mean_update_stats(stats, ptx_losses if run.ptx is not None else None, with_critic=False)
    metrics.update(run.rollout_metrics(batches, with_values=False))
    timing = {"e2e_s": time.perf_counter() - t0, "generation_s": gen_s, "training_s": train_s}
    return {**metrics, **timing, "actor_lr": roles.actor.get_lr()[0]}

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

**Sequence parallelism** (``sequence_parallel_size`` s > 1), as in GRPO: the ``s`` ranks of an SP group share
their data rank's rollouts, each generating a ``1 / s`` share of the samples and all-gathering the rows in the group
(:mod:`hybridzero.rlhf.rollout.sp_split`); the actor's log-probs (``rollout/sp_logprobs.py``), the critic's
per-token values and the reward model's scores (``rollout/sp_values.py``) come from split forwards summed back to
whole rows, so GAE, both clipped losses and every metric are the ``s = 1`` numbers on the group's ranks; the losses
are scaled for the data-parallel ranks (:func:`~hybridzero.rlhf.steps.rl.step3.global_scale`), metrics count each SP
group once. The EMA actor's shards span the whole world as the actor's do, so step 4 is unchanged; the ptx step's LM
batch is shared by the group and split likewise (:func:`~hybridzero.rlhf.steps.rl.step3.ptx_update`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from hybridzero.rlhf.algorithms.ppo import clipped_value_loss, gae, kl_penalized_rewards, ppo_policy_loss
from hybridzero.rlhf.engines import Roles, data_sum
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
from hybridzero.token_budget import Chunk, row_chunks

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
    max_tokens: int | None = None,
) -> UpdateStats:
    """One PPO training step of the actor and the critic on one mini-batch of experience (``packed``: both
    forwards on packed rows; ``max_tokens``: in chunks of at most that many tokens, each chunk's token-mean loss
    weighted by its share of the mini-batch's action tokens, so the chunks' losses sum to the mini-batch's)."""
    critic = roles.critic
    assert critic is not None, "PPO needs a critic engine"
    mask = exp.action_mask
    n_tokens = float(mask.sum())
    scale = global_scale(roles.actor, n_tokens)
    chunks = row_chunks(roles.actor, exp.attention_mask, max_tokens)
    local = [0.0, 0.0, 0.0, 0.0]  # actor loss, critic loss, clip fraction, approx KL; each * n_tokens
    with roles.actor.backward_group():
        for rows, share in _parts(chunks, mask, n_tokens):
            logp = sequence_logprobs(
                roles.actor, exp.sequences[rows], exp.attention_mask[rows], packed, max_tokens, mask[rows]
            )
            actor_loss, stats = ppo_policy_loss(logp, exp.logprobs[rows], advantages[rows], mask[rows], clip=clip)
            roles.actor.backward(actor_loss * (share * scale))
            local[0] += float(actor_loss.detach()) * share * n_tokens
            local[2] += float(stats.clip_fraction) * share * n_tokens
            local[3] += float(stats.approx_kl) * share * n_tokens
    with critic.backward_group():
        for rows, share in _parts(chunks, mask, n_tokens):
            values = critic_values(critic, exp.sequences[rows], exp.attention_mask[rows], packed, max_tokens)
            critic_loss = clipped_value_loss(values, exp.values[rows], returns[rows], mask[rows], clip=clip_value)
            critic.backward(critic_loss * (share * scale))
            local[1] += float(critic_loss.detach()) * share * n_tokens
    skipped = step_both(roles.actor, critic)
    sums = data_sum(roles.actor, [*local, n_tokens])  # each SP group once
    n = max(sums[4], 1.0)
    return UpdateStats(sums[0] / n, sums[1] / n, sums[2] / n, sums[3] / n, skipped)


def _parts(chunks: list[Chunk], mask: torch.Tensor, n_tokens: float) -> Iterator[tuple[torch.Tensor, float]]:
    """``(rows, share)``: a chunk's row index and its weight times its share of the mini-batch's action
    tokens (1 for a single whole-batch chunk, as the unchunked token mean)."""
    for chunk in chunks:
        rows = torch.tensor(chunk.rows, dtype=torch.long, device=mask.device)
        if len(chunks) == 1:
            yield rows, chunk.weight
        else:
            yield rows, chunk.weight * float(mask[rows].sum()) / max(n_tokens, 1.0)


def ppo_iteration(run: Step3, it: int) -> dict[str, float]:
    """Iteration ``it`` of PPO (module docstring, steps 1-4); returns the iteration's global metrics."""
    s, roles = run.s, run.roles
    t0, synced = time.perf_counter(), run.sync_seconds()
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
                        max_tokens=s.max_tokens_per_batch,
                    )
                )
                if run.ptx is not None:
                    ptx_losses.append(
                        ptx_update(roles.actor, run.ptx.next_batch(), s.unsup_coef, s.max_tokens_per_batch)
                    )
    train_s = time.perf_counter() - t1
    if roles.ema is not None:  # 4. EMA
        roles.ema.ema_update_from(roles.actor, s.ema_beta)
    metrics = mean_update_stats(stats, ptx_losses if run.ptx is not None else None, with_critic=True)
    metrics.update(run.rollout_metrics(batches, with_values=True))
    timing = {"e2e_s": time.perf_counter() - t0, "generation_s": gen_s, "training_s": train_s}
    if run.vllm is not None:  # this rank's vLLM weight syncs (part of generation_s)
        timing["weight_sync_s"] = run.sync_seconds() - synced
    return {**metrics, **timing, "actor_lr": roles.actor.get_lr()[0]}

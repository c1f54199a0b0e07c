"""Step 3 updates: experience from a rollout, PPO (actor + critic) and GRPO (actor only) training steps.

The trainer only sequences engine calls; the math is :mod:`hybridzero.rlhf.algorithms`. Conventions:

* Every forward scores a rollout with positions from its attention mask
  (:func:`~hybridzero.rlhf.sampling.causal_kwargs`).
* Losses are **global** token means: each rank scales its local token mean by ``n_local * W / N_global`` (one
  counted all-reduce of the token count), so the engine's gradient average over ranks is exactly the mean over all
  tokens of the global mini-batch, whatever the world size.
* fp16: an overflow in the actor or the critic skips **both** updates (the overflowing engine moves its loss
  scale; the other is skipped without touching its scale), as DeepSpeed-Chat's ``align_overflow``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hybridzero.rlhf.algorithms import (
    clipped_value_loss,
    gae,
    gather_logprobs,
    grpo_advantages,
    grpo_loss,
    kl_penalized_rewards,
    ppo_policy_loss,
)
from hybridzero.rlhf.common import global_sum
from hybridzero.rlhf.experience import Experience
from hybridzero.rlhf.models import last_token_index
from hybridzero.rlhf.sampling import Rollout, causal_kwargs

__all__ = [
    "Roles",
    "Targets",
    "UpdateStats",
    "compute_targets",
    "grpo_update",
    "make_experience",
    "ppo_update",
    "ptx_update",
    "sequence_logprobs",
    "step_both",
]


@dataclass(frozen=True)
class Roles:
    """The step-3 engines; ``critic`` is ``None`` for GRPO, ``ema`` when the EMA actor is off."""

    actor: Any
    ref: Any
    reward: Any
    critic: Any = None
    ema: Any = None


@dataclass(frozen=True)
class Targets:
    """``[B, L]`` advantages and returns (PPO: GAE; GRPO: group advantage ``[B]`` and no returns)."""

    advantages: torch.Tensor
    returns: torch.Tensor | None


@dataclass(frozen=True)
class UpdateStats:
    """Detached scalars of one training step (global means)."""

    actor_loss: float
    critic_loss: float
    clip_fraction: float
    approx_kl: float
    skipped: bool


def sequence_logprobs(engine: Any, sequences: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, T-1]`` fp32 log-probabilities of each next token under ``engine``'s causal LM."""
    logits = engine(**causal_kwargs(sequences, attention_mask)).logits
    return gather_logprobs(logits[:, :-1], sequences[:, 1:])


def make_experience(roles: Roles, ro: Rollout) -> Experience:
    """Score a rollout with the old policy, the reference, the critic (zeros for GRPO) and the reward model."""
    seq, mask = ro.sequences, ro.attention_mask
    with torch.no_grad():
        for engine in (roles.actor, roles.ref, roles.reward, roles.critic):
            if engine is not None:
                engine.eval()
        logprobs = sequence_logprobs(roles.actor, seq, mask)
        ref_logprobs = sequence_logprobs(roles.ref, seq, mask)
        values = roles.critic(input_ids=seq, attention_mask=mask)[:, :-1] if roles.critic is not None else \
            torch.zeros_like(logprobs)
        scores = roles.reward(input_ids=seq, attention_mask=mask)
        rewards = scores.gather(1, last_token_index(mask)[:, None]).squeeze(1)
        for engine in (roles.actor, roles.critic):
            if engine is not None:
                engine.train()
    return Experience(sequences=seq, attention_mask=mask, action_mask=ro.action_mask, logprobs=logprobs.float(),
                      ref_logprobs=ref_logprobs.float(), values=values.float(), rewards=rewards.float()).validate()


def compute_targets(exp: Experience, *, kl_coef: float, clip_reward: float, gamma: float, lam: float) -> Targets:
    """PPO: KL-penalised per-token rewards, then GAE over the action tokens."""
    rewards = kl_penalized_rewards(exp.logprobs, exp.ref_logprobs, exp.rewards, exp.action_mask,
                                   kl_coef=kl_coef, clip_reward=clip_reward)
    advantages, returns = gae(rewards, exp.values, exp.action_mask, gamma=gamma, lam=lam)
    return Targets(advantages=advantages, returns=returns)


def _global_scale(engine: Any, n_local: float) -> float:
    """``n_local * W / N_global`` (see module docstring); 0 when the global count is 0."""
    total, = global_sum(engine, [n_local])
    return 0.0 if total == 0 else n_local * engine.comm.world_size / total


def step_both(actor: Any, critic: Any | None) -> bool:
    """Apply the pending actor and critic steps, or skip both when either overflowed (fp16). Returns skipped."""
    engines = [e for e in (actor, critic) if e is not None]
    boundary = all(e.is_gradient_accumulation_boundary() for e in engines)
    overflow = [e.check_overflow() for e in engines] if boundary else [False] * len(engines)
    for engine, own in zip(engines, overflow):
        if any(overflow) and not own:
            engine.skip_step()
        else:
            engine.step()
    return any(overflow)


def ppo_update(roles: Roles, exp: Experience, targets: Targets, *, clip: float, clip_value: float) -> UpdateStats:
    """One PPO training step of the actor and the critic on one mini-batch of experience."""
    mask = exp.action_mask
    n_tokens = float(mask.sum())
    logp = sequence_logprobs(roles.actor, exp.sequences, exp.attention_mask)
    actor_loss, stats = ppo_policy_loss(logp, exp.logprobs, targets.advantages, mask, clip=clip)
    scale = _global_scale(roles.actor, n_tokens)
    roles.actor.backward(actor_loss * scale)
    values = roles.critic(input_ids=exp.sequences, attention_mask=exp.attention_mask)[:, :-1]
    assert targets.returns is not None
    critic_loss = clipped_value_loss(values, exp.values, targets.returns, mask, clip=clip_value)
    roles.critic.backward(critic_loss * scale)
    skipped = step_both(roles.actor, roles.critic)
    sums = global_sum(roles.actor, [float(actor_loss.detach()) * n_tokens, float(critic_loss.detach()) * n_tokens,
                                    float(stats.clip_fraction) * n_tokens, float(stats.approx_kl) * n_tokens,
                                    n_tokens])
    n = max(sums[4], 1.0)
    return UpdateStats(sums[0] / n, sums[1] / n, sums[2] / n, sums[3] / n, skipped)


def grpo_update(roles: Roles, exp: Experience, advantages: torch.Tensor, *, clip: float,
                kl_coef: float) -> UpdateStats:
    """One GRPO training step of the actor (group advantages ``[B]``; KL to the reference in the loss)."""
    logp = sequence_logprobs(roles.actor, exp.sequences, exp.attention_mask)
    loss, stats = grpo_loss(logp, exp.logprobs, exp.ref_logprobs, advantages, exp.action_mask,
                            clip=clip, kl_coef=kl_coef)
    n_seq = float(exp.batch_size)
    roles.actor.backward(loss * _global_scale(roles.actor, n_seq))
    skipped = step_both(roles.actor, None)
    n_tokens = float(exp.action_mask.sum())
    sums = global_sum(roles.actor, [float(loss.detach()) * n_seq, n_seq, float(stats.clip_fraction) * n_tokens,
                                    float(stats.approx_kl) * n_tokens, n_tokens])
    return UpdateStats(sums[0] / max(sums[1], 1.0), 0.0, sums[2] / max(sums[4], 1.0), sums[3] / max(sums[4], 1.0),
                       skipped)


def grpo_targets(exp: Experience, group_size: int) -> torch.Tensor:
    """``[B]`` group-relative advantages of the rollout's rewards (groups are contiguous rows)."""
    return grpo_advantages(exp.rewards, group_size)


def ptx_update(actor: Any, batch: dict[str, torch.Tensor], coef: float) -> float:
    """DeepSpeed-Chat's unsupervised step: ``coef x`` the LM loss (global token mean) as a separate actor step;
    returns the global mean LM loss (before ``coef``)."""
    batch = {k: v.to(actor.device) for k, v in batch.items()}
    labels = batch["labels"]
    n_tokens = float((labels[:, 1:] != -100).sum())
    loss = actor(**batch).loss
    actor.backward(coef * loss * _global_scale(actor, n_tokens))
    step_both(actor, None)
    total, count = global_sum(actor, [float(loss.detach()) * n_tokens, n_tokens])
    return total / max(count, 1.0)


def rollout_stats(exp: Experience) -> dict[str, float]:
    """Local sums for the step's metrics: rewards, per-token KL and critic values, action tokens, samples."""
    mask = exp.action_mask.bool()
    kl = torch.where(mask, exp.logprobs - exp.ref_logprobs, torch.zeros_like(exp.logprobs))
    return {"reward": float(exp.rewards.sum()), "kl": float(kl.sum()), "tokens": float(mask.sum()),
            "samples": float(exp.batch_size),
            "value": float(torch.where(mask, exp.values, torch.zeros_like(exp.values)).sum())}

"""GRPO family: one iteration, top to bottom — rollout, rewards, advantages, update, EMA. No critic.

1. **Rollout.** ``group_size`` samples of every prompt (contiguous rows, each with its own sampling seed), up to
   ``max_completion_length`` tokens or a stop string, scored by the actor (old log-probs, recorded once for all
   ``num_iterations`` passes; none when the iteration is one on-policy step: they are then the update forward's
   own, detached, :mod:`~hybridzero.rlhf.steps.rl.old_policy`) and, with ``beta > 0``, the reference
   (:meth:`Step3.rollout`).
2. **Rewards.** Reward functions and/or the reward model, weighted; failures raised on every rank or skipped
   (:mod:`hybridzero.rlhf.rewards.sources`); DAPO's overlong shaping and dynamic sampling
   (:mod:`hybridzero.rlhf.steps.rl.grpo_rollout`).
3. **Advantages.** Per group: mean or leave-one-out baseline, scaled by the group's, the batch's or no std
   (:func:`~hybridzero.rlhf.algorithms.grpo.group_advantages`).
4. **Update.** ``num_iterations`` passes over the iteration's experience in mini-batches: the clipped loss (token or
   sequence importance ratio, ``epsilon`` / ``epsilon_high``, k3 KL with ``beta``) aggregated per ``loss_type``
   with *global* normalisers (:mod:`hybridzero.rlhf.algorithms.grpo`), so every world size takes the same step; each
   mini-batch is cut to its own used columns first (padding); then a ptx step when a ptx dataset is given.
5. **EMA.** The EMA actor moves towards the actor (:meth:`Engine.ema_update_from`).

Every prompt's group lives on one rank and in one training mini-batch (checked by the settings).

**Sequence parallelism** (``sequence_parallel_size`` s > 1). The prompts are dealt to the ``W / s`` data-parallel
ranks; a decode step has one token and cannot be split by sequence, so the ``s`` ranks of an SP group split their
data rank's samples instead: each generates a contiguous ``1 / s`` share (on the hf engine, tensor-parallel or not,
or on its own vLLM engine; each sample's answer depends only on its own seed and logits:
:mod:`hybridzero.rlhf.rollout.generate`), and the rows are all-gathered over the group in sample order
(:mod:`hybridzero.rlhf.rollout.sp_split`), so every rank holds the same rows, bitwise, and generation costs each rank
about ``1 / s`` of the data rank's. Every rank makes the same generation calls (a rank with an empty share generates a
placeholder row), including DAPO's refills (the group's dead groups are the same on its ranks: SP rank 0's scores,
broadcast). Every log-prob forward (old policy, reference, the update) is split over the group by sequence and
summed back to whole rows (:mod:`hybridzero.rlhf.rollout.sp_logprobs`), and so is the reward model's scoring forward
(:mod:`hybridzero.rlhf.rollout.sp_values`: each score is read from whole rows summed over the group), so the GRPO
loss, its normalisers and every metric are computed from whole sequences, identically on the ``s`` ranks: sums over
ranks count each SP group once (:func:`~hybridzero.rlhf.engines.data_sum`) and the loss is scaled by the
data-parallel size, not the world (the log-probs' backward gives each rank ``s`` times its slice's part, which the
engine's division by ``W`` turns into the ``s = 1`` gradient). So every loss type and importance-sampling level
(GSPO's per-sequence ratio needs the whole answer) runs unchanged.
"""

from __future__ import annotations

import time

import torch

from hybridzero.packed_forward import row_capacity
from hybridzero.packing import packed_slots, sequence_lengths
from hybridzero.rlhf.algorithms.grpo import aggregate_loss, batch_std, clipped_policy_loss, group_advantages
from hybridzero.rlhf.engines import data_sum
from hybridzero.rlhf.rollout.experience import Experience
from hybridzero.rlhf.rollout.generate import sequence_logprobs, used_columns
from hybridzero.rlhf.settings import GRPOSettings
from hybridzero.rlhf.steps.rl.grpo_rollout import GroupBatch, sample_groups
from hybridzero.rlhf.steps.rl.old_policy import check_on_policy
from hybridzero.rlhf.steps.rl.step3 import (
    Step3,
    UpdateStats,
    mean_update_stats,
    ptx_update,
    slice_experience,
    step_both,
)
from hybridzero.runtime.engine import Engine
from hybridzero.token_budget import maybe_chunked, row_chunks

__all__ = ["advantages_of", "grpo_iteration", "grpo_update", "trim_experience"]


def advantages_of(run: Step3, gb: GroupBatch) -> torch.Tensor:
    """``[B]`` advantages of a generation batch (step 3); ``scale_rewards="batch"`` all-reduces the batch's std."""
    s = run.s
    assert isinstance(s, GRPOSettings)
    rewards = torch.where(gb.skipped, torch.full_like(gb.rb.exp.rewards.cpu(), float("nan")), gb.rb.exp.rewards.cpu())
    scale = None
    if s.scale_rewards == "batch":
        kept = rewards[~gb.skipped].double()
        n, total, sq = data_sum(run.roles.actor, [float(kept.numel()), float(kept.sum()), float((kept**2).sum())])
        scale = batch_std(n, total, sq)
    adv = group_advantages(rewards, s.group_size, baseline=s.baseline, scale=s.scale_rewards, batch_scale=scale)
    return adv.to(gb.rb.exp.rewards.device)


def trim_experience(exp: Experience) -> Experience:
    """``exp`` without the columns that are padding in every row (positions come from the mask: same results)."""
    lo, hi = used_columns(exp.attention_mask)
    per_token = ("action_mask", "logprobs", "ref_logprobs", "values")
    return Experience(
        **{
            f: getattr(exp, f)[:, lo : hi - 1] if f in per_token else getattr(exp, f)[:, lo:hi]
            for f in ("sequences", "attention_mask", *per_token)
        },
        rewards=exp.rewards,
    )


def _slots(actor: Engine, attention_mask: torch.Tensor, packed: bool, budgeted: bool = False) -> int:
    """Forward slots of a training mini-batch: its trimmed ``[b, t]`` or, packed, its packed rows at the capacity
    the actor's forward uses (with a token budget each chunk is one row exactly as wide as its tokens: the real
    tokens)."""
    if budgeted:
        return int(attention_mask.bool().sum())
    if not packed:
        return attention_mask.numel()
    if actor.sequence_parallel is not None:  # SP packs rows as wide as the longest sequence (sp_logprobs)
        return packed_slots(attention_mask)
    return packed_slots(attention_mask, row_capacity(actor, sequence_lengths(attention_mask)))


def _score_old_policy(run: Step3, exp: Experience) -> None:
    """Fill ``exp.logprobs`` (a view of the generation batch's experience) with the actor's no-grad log-probs: a
    mini-batch scored without the old log-prob pass that takes no update (no training token on any rank, so every
    rank comes here together: the forward gathers parameters) still feeds the rollout KL metric."""
    s, actor = run.s, run.roles.actor
    budget = s.max_tokens_per_batch
    with torch.no_grad():
        logp = maybe_chunked(
            actor,
            lambda q, m: sequence_logprobs(
                actor, q, m, s.packing_samples, s.max_tokens_per_batch, exp.action_mask if budget is None else None
            ),
            exp.sequences,
            exp.attention_mask,
            s.max_tokens_per_batch,
        )
    exp.logprobs.copy_(logp.to(exp.logprobs.dtype))


def grpo_update(
    run: Step3,
    exp: Experience,
    adv: torch.Tensor,
    trains: torch.Tensor,
    counted: torch.Tensor,
    policy_step: int | None = None,
) -> UpdateStats:
    """One actor step on a mini-batch: ``trains [b]`` rows enter the loss, ``counted [b]`` (not skipped) rows count
    in the normalisers. A mini-batch without a training token anywhere takes no step (reported as skipped).
    ``policy_step`` not None: the batch was scored without the old log-prob pass (:mod:`.old_policy`); the old
    log-probs are this forward's own, detached; with a KL term they are written into ``exp.logprobs`` (a view of the
    generation batch's experience) for the rollout KL metric that reads them afterwards."""
    s, actor = run.s, run.roles.actor
    assert isinstance(s, GRPOSettings)
    check_on_policy(policy_step, actor.global_steps)
    mask = exp.action_mask.bool() & trains.to(exp.action_mask.device)[:, None]
    n_seqs, n_tokens = data_sum(actor, [float(counted.sum()), float(mask.sum())])
    data_ranks = actor.comm.world_size // (actor.sequence_parallel.size if actor.sequence_parallel else 1)
    if n_tokens == 0:
        if policy_step is not None and s.grpo_kl_coef:  # no update forward: score the old policy for the KL metric
            _score_old_policy(run, exp)
        return UpdateStats(0.0, 0.0, 0.0, 0.0, True)
    loss_sum, clip_sum, kl_sum = 0.0, 0.0, 0.0
    with actor.backward_group():  # one chunk (the whole mini-batch) unless max_tokens_per_batch splits it
        for chunk in row_chunks(actor, exp.attention_mask, s.max_tokens_per_batch):
            rows = torch.tensor(chunk.rows, dtype=torch.long, device=exp.sequences.device)
            logp = sequence_logprobs(
                actor,
                exp.sequences[rows],
                exp.attention_mask[rows],
                s.packing_samples,
                s.max_tokens_per_batch,
                exp.action_mask[rows],
            )
            if policy_step is not None and s.grpo_kl_coef:  # the rollout KL metric reads them (zero KL without)
                exp.logprobs[rows] = logp.detach().to(exp.logprobs.dtype)
            out = clipped_policy_loss(
                logp,
                exp.logprobs[rows] if policy_step is None else logp.detach(),
                exp.ref_logprobs[rows] if s.grpo_kl_coef else None,
                adv[rows.to(adv.device)],
                mask[rows],
                eps_low=s.cliprange,
                eps_high=s.clip_high,
                level=s.importance_sampling_level,
                beta=s.grpo_kl_coef,
            )  # per-row terms over the mini-batch's global normalisers: the chunks' losses sum to the mini-batch's
            loss = chunk.weight * aggregate_loss(
                out.per_token,
                mask[rows],
                s.loss_type,
                num_seqs=n_seqs,
                num_tokens=n_tokens,
                max_len=s.max_answer_seq_len,
            )
            actor.backward(loss * data_ranks)  # the engine averages over ranks; the shares sum to the loss (SP: above)
            local = chunk.weight * float(mask[rows].sum())
            loss_sum += float(loss.detach())
            clip_sum += float(out.clip_fraction) * local
            kl_sum += float(out.approx_kl) * local
    skipped = step_both(actor, None)
    sums = data_sum(actor, [loss_sum, clip_sum, kl_sum])
    return UpdateStats(sums[0], 0.0, sums[1] / n_tokens, sums[2] / n_tokens, skipped)


def _rollout_metrics(run: Step3, batches: list[GroupBatch], padding: list[float]) -> dict[str, float]:
    """Global reward metrics: combined reward over scored samples, each source's mean over what it scored,
    skipped samples, regenerated groups, truncated answers, and the padding fraction of the training forwards."""
    names = run.rewarder.names if run.rewarder is not None else []
    local = [0.0] * (6 + 2 * len(names))
    for gb in batches:
        kept = ~gb.skipped
        local[0] += float(gb.rb.exp.rewards.cpu()[kept].sum())
        local[1] += float(kept.sum())
        local[2] += float(gb.skipped.sum())
        local[3] += float(gb.resampled)
        local[4] += float((~gb.rb.finished.cpu()).sum()) if gb.rb.finished is not None else 0.0
        local[5] += float(gb.rb.exp.batch_size)
        for j in range(len(names)):
            scored = ~torch.isnan(gb.per_source[j])
            local[6 + 2 * j] += float(gb.per_source[j][scored].sum())
            local[7 + 2 * j] += float(scored.sum())
    total = data_sum(run.roles.actor, local + padding)
    out = {
        "reward": total[0] / max(total[1], 1.0),
        "skipped_samples": total[2],
        "resampled_groups": total[3],
        "truncated_fraction": total[4] / max(total[5], 1.0),
    }
    for j, name in enumerate(names):
        out[f"rewards/{name}"] = total[6 + 2 * j] / max(total[7 + 2 * j], 1.0)
    real, full, trimmed = total[-3:]
    out["pad_fraction_untrimmed"] = 1.0 - real / max(full, 1.0)
    out["pad_fraction"] = 1.0 - real / max(trimmed, 1.0)
    return out


def grpo_iteration(run: Step3, it: int) -> dict[str, float]:
    """Iteration ``it`` (module docstring, steps 1-5); returns the iteration's global metrics."""
    s, roles = run.s, run.roles
    assert isinstance(s, GRPOSettings)
    t0, synced = time.perf_counter(), run.sync_seconds()
    batches = [sample_groups(run, it, b) for b in range(s.generation_batches)]  # 1. rollout, 2. rewards
    t1 = time.perf_counter()
    advantages = [advantages_of(run, gb) for gb in batches]  # 3. advantages
    stats, ptx_losses, padding = [], [], [0.0, 0.0, 0.0]
    for _ in range(s.ppo_epochs):  # 4. update (old log-probs from the rollout, for every pass)
        for gb, adv in zip(batches, advantages):
            for lo, hi in run.minibatches(gb.rb.exp):
                full = slice_experience(gb.rb.exp, lo, hi)
                mb = trim_experience(full)
                padding = [
                    padding[0] + float(full.attention_mask.sum()),
                    padding[1] + float(full.attention_mask.numel()),
                    padding[2]
                    + float(
                        _slots(roles.actor, mb.attention_mask, s.packing_samples, s.max_tokens_per_batch is not None)
                    ),
                ]
                mb_adv = adv[lo:hi]
                if gb.rb.is_weights is not None:  # truncated IS (vLLM): w * A per token (w > 0, so = w * loss)
                    c_lo, c_hi = used_columns(full.attention_mask)
                    mb_adv = mb_adv[:, None] * gb.rb.is_weights[lo:hi, c_lo : c_hi - 1]
                stats.append(grpo_update(run, mb, mb_adv, gb.trains[lo:hi], ~gb.skipped[lo:hi], gb.rb.policy_step))
                if run.ptx is not None:
                    ptx_losses.append(
                        ptx_update(roles.actor, run.ptx.next_batch(), s.unsup_coef, s.max_tokens_per_batch)
                    )
    train_s = time.perf_counter() - t1
    if roles.ema is not None:  # 5. EMA
        roles.ema.ema_update_from(roles.actor, s.ema_beta)
    metrics = mean_update_stats(stats, ptx_losses if run.ptx is not None else None, with_critic=False)
    metrics.update(run.rollout_metrics([gb.rb for gb in batches], with_values=False))
    metrics.update(_rollout_metrics(run, batches, padding))
    metrics["old_logprob_pass"] = float(any(gb.rb.policy_step is None for gb in batches))
    timing = {"e2e_s": time.perf_counter() - t0, "generation_s": t1 - t0, "training_s": train_s}
    if run.vllm is not None:  # this rank's vLLM weight syncs (part of generation_s)
        timing["weight_sync_s"] = run.sync_seconds() - synced
    return {**metrics, **timing, "actor_lr": roles.actor.get_lr()[0]}

"""GRPO's rollout with rewards: generate groups, score them with the reward sources, refill dead groups (DAPO).

:func:`sample_groups` returns one generation batch of this rank as a :class:`GroupBatch`: the experience (its
``rewards`` field holds the combined reward: functions, reward model and DAPO's overlong shaping), which samples are
skipped (a failed or unscored sample under ``reward_error_policy=skip``), which rows train, and the per-source rewards.

**Dynamic sampling** (DAPO eq. (11), ``dynamic_sampling``): after scoring, a group whose rewards are all equal (or
with fewer than 2 scored samples) carries no gradient. Up to ``max_resample_rounds`` times, while the *global* count
of such groups is above 0, every rank regenerates its dead groups — same prompts, same sample ids, run seed
``seed + round x 1000003`` — and scores them; live replacements take the old rows' places, still-dead ones are
retried next round, and after the last round the remaining dead groups stay (advantage 0). A rank without a dead
group regenerates its first group and discards it, because generation and scoring gather parameters and the reward
agreement is a collective: every rank makes the same calls in every round. Each group's fate depends only on its
own samples, so the refilled batch is the same at every world size. Under sequence parallelism the ranks of an SP
group hold the same rows and SP rank 0's scores, so they find the same dead groups and split each refill's samples
among themselves like any rollout (:meth:`~hybridzero.rlhf.steps.rl.step3.Step3.sample`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from hybridzero.rlhf.algorithms.grpo import degenerate_groups, overlong_penalty
from hybridzero.rlhf.engines import data_sum
from hybridzero.rlhf.rewards.sources import Scored
from hybridzero.rlhf.rollout.experience import Experience
from hybridzero.rlhf.settings import GRPOSettings
from hybridzero.rlhf.steps.rl.step3 import RolloutBatch, Step3

__all__ = ["GroupBatch", "sample_groups", "score_rollout"]

_RESAMPLE_SEED_STRIDE = 1_000_003


@dataclass(frozen=True)
class GroupBatch:
    """One generation batch of this rank, scored. ``rb.exp.rewards`` is the combined reward (0 where skipped);
    ``skipped [B]``: no reward (no gradient, not counted); ``trains [B]``: rows whose tokens enter the loss
    (not skipped, and finished unless ``mask_truncated_completions`` is off); ``per_source [S, B]`` (NaN: the
    source did not score); ``resampled``: groups regenerated on this rank."""

    rb: RolloutBatch
    skipped: torch.Tensor
    trains: torch.Tensor
    per_source: torch.Tensor
    resampled: int


def _completion_ids(run: Step3, exp: Experience) -> list[list[int]]:
    """Each row's answer tokens (up to and including EOS; stop-string cut applied)."""
    width = run.s.max_prompt_seq_len
    seq, mask = exp.sequences[:, width:].cpu(), exp.attention_mask[:, width:].cpu().bool()
    return [row[m].tolist() for row, m in zip(seq, mask)]


def score_rollout(run: Step3, rb: RolloutBatch) -> Scored:
    """The reward sources on a rollout batch, plus DAPO's overlong shaping on the scored samples."""
    s, rewarder = run.s, run.rewarder
    assert isinstance(s, GRPOSettings) and rewarder is not None
    prompts, completions = run.texts(rb)
    keys = sorted({k for i in set(rb.prompt_ids) for k in run.prompt_extras[i]})
    columns = {k: [run.prompt_extras[i].get(k) for i in rb.prompt_ids] for k in keys}
    scored = rewarder.score(
        run.roles.actor, prompts, completions, _completion_ids(run, rb.exp), columns, rb.exp.rewards
    )
    scored = _same_in_sp_group(run, scored)
    if s.overlong_buffer_length == 0:
        return scored
    shaping = overlong_penalty(
        rb.exp.num_actions.cpu(),
        max_len=s.max_answer_seq_len,
        buffer=s.overlong_buffer_length,
        penalty=s.overlong_penalty,
    )
    rewards = torch.where(scored.skipped, scored.rewards, scored.rewards + shaping)
    return replace(scored, rewards=rewards)


def _same_in_sp_group(run: Step3, scored: Scored) -> Scored:
    """SP rank 0's scores on every rank of its SP group (the group's ranks scored the same rows; a reward function
    that is not deterministic must not give them different rewards, skips or per-source values)."""
    actor = run.roles.actor
    sp = actor.sequence_parallel
    if sp is None:
        return scored
    out = {}
    for name in ("rewards", "skipped", "per_source"):
        t = getattr(scored, name)
        held = t.to(device=actor.device, dtype=torch.float64).contiguous()
        sp.comm.broadcast(held, 0, phase="rewards")
        out[name] = held.to(device=t.device, dtype=t.dtype)
    return Scored(**out)


def _with_rows(old: RolloutBatch, new: RolloutBatch, rows: list[int], src: list[int]) -> RolloutBatch:
    """``old`` with rows ``rows`` replaced by ``new``'s rows ``src`` (every field; fixed layout, so shapes match)."""
    fields = {}
    for name in Experience.__dataclass_fields__:
        t = getattr(old.exp, name).clone()
        t[rows] = getattr(new.exp, name)[src].to(t.dtype)
        fields[name] = t
    finished = old.finished
    if finished is not None and new.finished is not None:
        finished = finished.clone()
        finished[rows] = new.finished[src]
    weights = old.is_weights
    if weights is not None and new.is_weights is not None:
        weights = weights.clone()
        weights[rows] = new.is_weights[src]
    return replace(old, exp=Experience(**fields), finished=finished, is_weights=weights)


def _replace_scored(old: Scored, new: Scored, rows: list[int], src: list[int]) -> Scored:
    out = {}
    for name in ("rewards", "skipped", "per_source"):
        t = getattr(old, name).clone()
        t[..., rows] = getattr(new, name)[..., src]
        out[name] = t
    return Scored(**out)


def _masked(scored: Scored) -> torch.Tensor:
    return torch.where(scored.skipped, torch.full_like(scored.rewards, float("nan")), scored.rewards)


def _refill(run: Step3, rb: RolloutBatch, scored: Scored) -> tuple[RolloutBatch, Scored, int]:
    """Dynamic sampling (module docstring); returns the refilled batch, its scores and the groups regenerated."""
    s = run.s
    assert isinstance(s, GRPOSettings) and rb.sample_ids is not None
    k, resampled = s.group_size, 0
    for round_ in range(1, s.max_resample_rounds + 1):
        dead = degenerate_groups(_masked(scored), k).nonzero().flatten().tolist()
        (total,) = data_sum(run.roles.actor, [float(len(dead))])
        if total == 0:
            break
        groups = dead or [0]  # a placeholder keeps this rank in step with the others
        rows = [g * k + j for g in groups for j in range(k)]
        new = run.sample(
            [rb.prompt_ids[r] for r in rows], [rb.sample_ids[r] for r in rows], s.seed + round_ * _RESAMPLE_SEED_STRIDE
        )
        new_scored = score_rollout(run, new)
        if not dead:
            continue
        live = ~degenerate_groups(_masked(new_scored), k)
        keep = [i for i, g in enumerate(groups) if bool(live[i])]
        dst = [groups[i] * k + j for i in keep for j in range(k)]
        src = [i * k + j for i in keep for j in range(k)]
        if dst:
            rb, scored = _with_rows(rb, new, dst, src), _replace_scored(scored, new_scored, dst, src)
        resampled += len(groups)
    return rb, scored, resampled


def sample_groups(run: Step3, it: int, batch: int) -> GroupBatch:
    """Generate, score and (dynamic sampling) refill generation batch ``batch`` of iteration ``it``."""
    s = run.s
    assert isinstance(s, GRPOSettings)
    rb = run.rollout(it, batch)
    scored = score_rollout(run, rb)
    resampled = 0
    if s.dynamic_sampling:
        rb, scored, resampled = _refill(run, rb, scored)
    rb = replace(rb, exp=replace(rb.exp, rewards=scored.rewards.to(rb.exp.rewards.device)))
    trains = ~scored.skipped
    if s.mask_truncated_completions and rb.finished is not None:
        trains = trains & rb.finished.cpu()
    return GroupBatch(rb, scored.skipped, trains, scored.per_source, resampled)

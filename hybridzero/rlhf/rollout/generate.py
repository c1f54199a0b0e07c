"""Rollout and experience: generation with sampling seeded per sample (not per rank), then scoring by every role.

Each sequence ``i`` of a rollout owns a ``torch.Generator`` seeded from ``(run seed, sample id)``; at every decoding
step it draws ``V`` uniforms from its own generator and picks ``argmax(logits / T + Gumbel)``, which is an exact
sample of ``softmax(logits / T)`` (the Gumbel-max trick) and depends on nothing but the sample's own logits and
draws. So the same sample id gets the same answer on any rank, at any world size, in any batch composition (up to
fp32 rounding of its logits), and a resumed run repeats the samples of the run it resumes.

:func:`rollout` pads prompts to a fixed width ``P`` (left) and answers to ``A`` (right), so every sequence is
``[P + A]`` whatever the batch: the experience layout of :mod:`hybridzero.rlhf.rollout.experience`. Decoding itself
runs on
the batch's own prompt width (its longest prompt), and scoring on the batch's used columns (:func:`used_columns`):
positions come from the attention mask, so the all-padding columns only cost work. The answer is the
generated tokens up to and including the first EOS; later positions are pad and 0 in the masks.

:func:`make_experience` scores a rollout with the old policy, the reference, the critic and the reward model
(every forward with positions from the attention mask, :func:`causal_kwargs`) into a typed
:class:`~hybridzero.rlhf.rollout.experience.Experience`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from hybridzero.head_select import next_token_logprobs_at
from hybridzero.packed_forward import packed_last_values, packed_logprobs, packed_values
from hybridzero.rlhf.algorithms.ppo import gather_logprobs
from hybridzero.rlhf.engines import Roles
from hybridzero.rlhf.models import last_token_index, position_ids
from hybridzero.rlhf.rollout.experience import Experience
from hybridzero.rlhf.rollout.sp_logprobs import sp_logprobs
from hybridzero.rlhf.rollout.sp_values import sp_last_values, sp_token_values
from hybridzero.rlhf.rollout.stops import StopOnStrings, cut_after_stop
from hybridzero.runtime.engine import Engine
from hybridzero.token_budget import maybe_chunked

__all__ = [
    "Rollout",
    "SampleNoise",
    "answer_masks",
    "causal_kwargs",
    "critic_values",
    "fit_width",
    "lay_out",
    "make_experience",
    "rollout",
    "rollout_stats",
    "sample_seed",
    "sequence_logprobs",
    "used_columns",
]

_MIX = 0x9E3779B97F4A7C15
_MASK64 = (1 << 63) - 1


def sample_seed(run_seed: int, sample_id: int) -> int:
    """A 63-bit generator seed from ``(run_seed, sample_id)`` (splitmix-style mixing; pure)."""
    z = (run_seed * _MIX + sample_id + 1) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & _MASK64


class SampleNoise:
    """A Hugging Face logits processor: temperature, optional top-k, and per-row Gumbel noise (see module doc).

    Used with greedy decoding (``do_sample=False``): the argmax of the returned scores is the sample.
    """

    def __init__(self, seeds: Sequence[int], temperature: float = 1.0, top_k: int = 0) -> None:
        self.generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
        self.temperature = float(temperature)
        self.top_k = int(top_k)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """``[B, V]`` scores -> noisy scores; row ``b`` draws ``V`` uniforms from its own generator."""
        scores = scores.float() / self.temperature
        if 0 < self.top_k < scores.shape[-1]:
            kth = scores.topk(self.top_k, dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        vocab = scores.shape[-1]
        tiny = torch.finfo(torch.float32).tiny
        uniforms = torch.stack([torch.rand(vocab, generator=g) for g in self.generators]).clamp_(tiny, 1.0 - 1e-7)
        gumbel = -torch.log(-torch.log(uniforms))
        return scores + gumbel.to(scores.device)


@dataclass(frozen=True)
class Rollout:
    """``sequences [B, P+A]`` (left-padded prompt, right-padded answer), ``attention_mask [B, P+A]``,
    ``action_mask [B, P+A-1]`` (shifted space: 1 where token t+1 is an answer token) and ``prompt_width`` P."""

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    prompt_width: int
    finished: torch.Tensor | None = None  # [B] bool: the answer ended (EOS or a stop string) within the limit


def answer_masks(answers: torch.Tensor, eos_id: int | None) -> torch.Tensor:
    """``[B, A]`` int64: 1 on answer tokens up to and including the first ``eos_id`` (all 1 without an EOS)."""
    if eos_id is None:
        return torch.ones_like(answers)
    is_eos = (answers == eos_id).long()
    before_or_at = (is_eos.cumsum(-1) - is_eos) == 0  # no EOS strictly before this position
    return before_or_at.long()


def fit_width(tokens: torch.Tensor, width: int, pad_id: int, left: bool) -> torch.Tensor:
    """Pad (or cut) ``[B, n]`` to ``[B, width]`` on the left or right."""
    n = tokens.shape[1]
    if n >= width:
        return tokens[:, n - width :] if left else tokens[:, :width]
    pad = torch.full((tokens.shape[0], width - n), pad_id, dtype=tokens.dtype, device=tokens.device)
    return torch.cat([pad, tokens] if left else [tokens, pad], dim=1)


def rollout(
    generate: Callable[..., torch.Tensor],
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    sample_ids: Sequence[int],
    run_seed: int,
    prompt_width: int,
    answer_len: int,
    pad_id: int,
    eos_id: int | None,
    do_sample: bool = True,
    temperature: float = 1.0,
    top_k: int = 0,
    extra: dict[str, Any] | None = None,
    stop: tuple[Any, Sequence[str]] | None = None,
) -> Rollout:
    """Generate ``answer_len`` tokens at most for each (left-padded) prompt and lay them out at fixed width.

    ``generate`` is ``engine.generate`` (hybrid engine) or ``module.generate`` (ZeRO-3 gathers per step); it gets
    HF ``generate`` keyword arguments. With ``do_sample`` each row samples with its own seed
    ``sample_seed(run_seed, sample_ids[row])``; otherwise decoding is greedy. ``stop = (tokenizer, strings)``
    stops rows at a stop string and cuts each answer right after it (:mod:`hybridzero.rlhf.rollout.stops`).
    """
    ids = fit_width(prompt_ids, prompt_width, pad_id, left=True)
    mask = fit_width(prompt_mask, prompt_width, 0, left=True)
    width = min(prompt_width, prompt_ids.shape[1])  # decode on the batch's own prompt width: the rest is padding
    kwargs: dict[str, Any] = {
        "attention_mask": mask[:, prompt_width - width :],
        "max_new_tokens": answer_len,
        "do_sample": False,
        "pad_token_id": pad_id,
        "use_cache": True,
        **(extra or {}),
    }
    if eos_id is not None:
        kwargs["eos_token_id"] = eos_id
    if do_sample:
        seeds = [sample_seed(run_seed, int(s)) for s in sample_ids]
        kwargs["logits_processor"] = LogitsProcessorList([SampleNoise(seeds, temperature, top_k)])
    if stop is not None and stop[1]:
        kwargs["stopping_criteria"] = StoppingCriteriaList([StopOnStrings(stop[0], stop[1], width)])
    with torch.no_grad():
        out = generate(ids[:, prompt_width - width :], **kwargs)
    return lay_out(ids, mask, out[:, width:], answer_len=answer_len, pad_id=pad_id, eos_id=eos_id, stop=stop)


def lay_out(
    ids: torch.Tensor,
    mask: torch.Tensor,
    generated: torch.Tensor,
    *,
    answer_len: int,
    pad_id: int,
    eos_id: int | None,
    stop: tuple[Any, Sequence[str]] | None = None,
) -> Rollout:
    """The fixed layout of :class:`Rollout` from prompts already at width ``P`` (``ids``, ``mask``) and the
    generated tokens ``[B, n]`` (right-padded; any rollout engine's): answers cut at the first EOS and at a stop
    string, padded to ``answer_len``."""
    prompt_width = ids.shape[1]
    answers = fit_width(generated, answer_len, pad_id, left=False)
    valid = answer_masks(answers, eos_id)
    finished = (answers == eos_id).any(dim=1) if eos_id is not None else torch.zeros_like(valid[:, 0]).bool()
    if stop is not None and stop[1]:
        lengths = valid.sum(dim=1)
        cut = cut_after_stop(stop[0], answers.cpu(), lengths.cpu(), stop[1]).to(valid.device)
        finished = finished | (cut < lengths)
        valid = (torch.arange(answer_len, device=valid.device)[None, :] < cut[:, None]).long()
    answers = torch.where(valid.bool(), answers, torch.full_like(answers, pad_id))
    sequences = torch.cat([ids, answers], dim=1)
    attention = torch.cat([mask, valid], dim=1)
    action = torch.zeros_like(attention[:, 1:])
    action[:, prompt_width - 1 :] = valid
    return Rollout(sequences, attention, action, prompt_width, finished)


def causal_kwargs(sequences: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor | bool]:
    """Forward keyword arguments for a causal LM scoring a rollout: ids, mask and mask-derived positions."""
    return {
        "input_ids": sequences,
        "attention_mask": attention_mask,
        "position_ids": position_ids(attention_mask),
        "use_cache": False,
    }


def sequence_logprobs(
    engine: Engine,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    packed: bool = False,
    capacity: int | None = None,
    wanted: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[B, T-1]`` fp32 log-probabilities of each next token under ``engine``'s causal LM (``packed``: on packed
    rows of ``capacity`` tokens, 0 where the next token is padding; :mod:`hybridzero.packed_forward`). An engine
    with sequence parallelism always forwards packed rows split over its SP group (:mod:`.sp_logprobs`; with a
    token budget's ``capacity`` the packed rows are that wide, each rank forwarding its ``1 / s`` of them).
    ``wanted [B, T-1]`` (the action mask): only those positions are computed, the output head running on them
    alone (:mod:`hybridzero.head_select`); the others are 0 (under SP every position is computed)."""
    if getattr(engine, "sequence_parallel", None) is not None:
        return sp_logprobs(engine, sequences, attention_mask, capacity if packed else None)
    if packed:
        return packed_logprobs(engine, sequences, attention_mask, capacity=capacity, wanted=wanted)
    if wanted is not None:
        keep = torch.cat([wanted.bool(), wanted.new_zeros(wanted.shape[0], 1, dtype=torch.bool)], dim=1)
        return next_token_logprobs_at(engine, causal_kwargs(sequences, attention_mask), sequences, keep)[:, :-1]
    logits = engine(**causal_kwargs(sequences, attention_mask)).logits
    return gather_logprobs(logits[:, :-1], sequences[:, 1:])


def critic_values(
    engine: Engine,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    packed: bool = False,
    capacity: int | None = None,
) -> torch.Tensor:
    """``[B, T-1]`` fp32 values of a value-head engine at positions ``0 .. T-2`` (``packed``: on packed rows of
    ``capacity`` tokens). An engine with sequence parallelism always forwards packed rows split over its SP group
    (:mod:`.sp_values`; ``capacity`` as in :func:`sequence_logprobs`)."""
    if getattr(engine, "sequence_parallel", None) is not None:
        return sp_token_values(engine, sequences, attention_mask, capacity if packed else None)[:, :-1]
    if packed:
        return packed_values(engine, sequences, attention_mask, capacity=capacity)[:, :-1]
    return engine(input_ids=sequences, attention_mask=attention_mask)[:, :-1]


def used_columns(attention_mask: torch.Tensor) -> tuple[int, int]:
    """``(lo, hi)``: the columns ``[lo, hi)`` a batch's tokens occupy (left and right padding of every row cut off;
    ``(0, 2)`` at least, so a batch always has one shifted position)."""
    cols = attention_mask.bool().any(dim=0).nonzero().flatten()
    if cols.numel() == 0:
        return 0, min(2, attention_mask.shape[1])
    lo, hi = int(cols[0]), int(cols[-1]) + 1
    return (lo, hi) if hi - lo >= 2 else (max(hi - 2, 0), max(hi, 2))


def _widen(part: torch.Tensor, lo: int, width: int) -> torch.Tensor:
    """``[B, w]`` per-token values of trimmed columns back at ``[B, width]``, zeros outside."""
    out = torch.zeros(part.shape[0], width, dtype=part.dtype, device=part.device)
    out[:, lo : lo + part.shape[1]] = part
    return out


def make_experience(
    roles: Roles,
    ro: Rollout,
    *,
    with_ref: bool = True,
    packed: bool = False,
    max_tokens: int | None = None,
    with_old: bool = True,
) -> Experience:
    """Score a rollout with the old policy, the reference (``with_ref``; else its log-probs are the old policy's:
    a zero KL), the critic (zeros for GRPO) and the reward model (zeros without one). ``with_old=False``: no actor
    pass; the old log-probs are zeros, to be taken from the update forward (:mod:`hybridzero.rlhf.steps.rl.
    old_policy`), and without ``with_ref`` the reference's are zeros too (still a zero KL).

    Every forward runs on the batch's used columns only (:func:`used_columns`): positions come from the attention
    mask, so cutting all-padding columns changes nothing but the work; the per-token results are put back at
    the fixed layout (zeros on the cut columns, which no mask selects). ``packed``: every forward on packed rows
    (:mod:`hybridzero.packed_forward`); the per-sample tensors are the same. ``max_tokens`` (with ``packed``):
    every forward in chunks of at most that many tokens (:mod:`hybridzero.token_budget`); under sequence parallelism
    each chunk's packed row is split over the SP group (the group's ranks hold the same rows, so plan the same
    chunks), about ``max_tokens / s`` tokens per rank."""
    lo, hi = used_columns(ro.attention_mask)
    seq, mask = ro.sequences[:, lo:hi], ro.attention_mask[:, lo:hi]
    width = ro.sequences.shape[1] - 1

    def run(engine: Engine, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return maybe_chunked(engine, fn, seq, mask, max_tokens)

    with torch.no_grad():
        for engine in (roles.actor, roles.ref, roles.reward, roles.critic):
            if engine is not None:
                engine.eval()
        actor, ref, critic, reward = roles.actor, roles.ref, roles.critic, roles.reward
        wanted = ro.action_mask[:, lo : hi - 1] if max_tokens is None else None  # chunks: every position
        logprobs = (
            run(actor, lambda q, m: sequence_logprobs(actor, q, m, packed, max_tokens, wanted))
            if with_old
            else torch.zeros(seq.shape[0], seq.shape[1] - 1, device=seq.device)
        )
        ref_logprobs = (
            run(ref, lambda q, m: sequence_logprobs(ref, q, m, packed, max_tokens, wanted))
            if with_ref
            else logprobs.clone()
        )
        values = (
            run(critic, lambda q, m: critic_values(critic, q, m, packed, max_tokens))
            if critic is not None
            else torch.zeros_like(logprobs)
        )
        if reward is not None and reward.sequence_parallel is not None:  # split over the SP group (.sp_values)
            rewards = run(reward, lambda q, m: sp_last_values(reward, q, m, capacity=max_tokens))
        elif reward is not None and packed:
            rewards = run(reward, lambda q, m: packed_last_values(reward, q, m, capacity=max_tokens))
        elif reward is not None:
            scores = reward(input_ids=seq, attention_mask=mask)
            rewards = scores.gather(1, last_token_index(mask)[:, None]).squeeze(1)
        else:
            rewards = torch.zeros(seq.shape[0], device=seq.device)
        for engine in (roles.actor, roles.critic):
            if engine is not None:
                engine.train()
    return Experience(
        sequences=ro.sequences,
        attention_mask=ro.attention_mask,
        action_mask=ro.action_mask,
        logprobs=_widen(logprobs.float(), lo, width),
        ref_logprobs=_widen(ref_logprobs.float(), lo, width),
        values=_widen(values.float(), lo, width),
        rewards=rewards.float(),
    ).validate()


def rollout_stats(exp: Experience) -> dict[str, float]:
    """Local sums for the step's metrics: rewards, per-token KL and critic values, action tokens, samples."""
    mask = exp.action_mask.bool()
    kl = torch.where(mask, exp.logprobs - exp.ref_logprobs, torch.zeros_like(exp.logprobs))
    return {
        "reward": float(exp.rewards.sum()),
        "kl": float(kl.sum()),
        "tokens": float(mask.sum()),
        "samples": float(exp.batch_size),
        "value": float(torch.where(mask, exp.values, torch.zeros_like(exp.values)).sum()),
    }

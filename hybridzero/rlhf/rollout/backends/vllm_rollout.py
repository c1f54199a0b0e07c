"""A step-3 rollout on a :class:`~hybridzero.rlhf.rollout.backends.vllm_engine.VLLMEngine`, in the layout of
:func:`hybridzero.rlhf.rollout.generate.rollout` (fixed ``[P + A]`` rows), plus the sampler's per-token log-probs.

Before generating, the engine takes the actor's weights if the actor has stepped since its last sync (every rank
calls this the same number of times with the same step count, so the sync's gathers stay in step). Each sample
draws with its own seed ``sample_seed(run_seed, sample id)`` inside vLLM: the same sample id gives the same answer
on any rank (and in any tensor-parallel group: :mod:`.vllm_tp` joins a group's prompts, each keeping its seed),
though not the answer the ``hf`` engine's Gumbel sampler draws. A failure on any rank (vLLM raising
while generating or taking weights) is raised on every rank at the same point (``comm.agree``): no rank is left
waiting in a collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hybridzero.rlhf.rollout.backends.base import SamplingSpec
from hybridzero.rlhf.rollout.backends.tp_failure import settle_group_call
from hybridzero.rlhf.rollout.backends.vllm_engine import VLLMEngine
from hybridzero.rlhf.rollout.backends.vllm_tp import TP_COMM_NAME, group_generate
from hybridzero.rlhf.rollout.generate import Rollout, fit_width, lay_out, sample_seed
from hybridzero.runtime.engine import Engine
from hybridzero.runtime.tp_generate import tp_groups

__all__ = ["ensure_synced", "vllm_rollout"]


def _unpadded(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """Each row's prompt tokens (left padding dropped)."""
    return [row[m.bool()].tolist() for row, m in zip(ids.cpu(), mask.cpu())]


def ensure_synced(engine: VLLMEngine, actor: Engine) -> None:
    """Start the engine and load the actor's weights unless they are already loaded (collective; agreed). With
    tensor parallelism the first call also builds the engine's group :class:`Comm` (a world collective)."""
    tp = engine.opts.tensor_parallel_size
    if tp > 1 and engine.group is None:
        engine.group = actor.comm.split(tp_groups(actor.comm.world_size, tp), name=TP_COMM_NAME)
    error: BaseException | None = None
    try:
        if engine.synced_step != actor.global_steps:
            engine.sync_weights(actor)
    except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
        error = exc
    actor.comm.agree(error, "the vLLM engine's start / weight sync", phase="rollout")


def vllm_rollout(
    engine: VLLMEngine,
    actor: Engine,
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
    stop: tuple[Any, Sequence[str]] | None = None,
) -> tuple[Rollout, torch.Tensor]:
    """``(rollout, sampler_logprobs [B, P+A-1])`` (``P = prompt_width``; prompts left-padded or cut to it, as
    :func:`~hybridzero.rlhf.rollout.generate.rollout` does); the log-probs sit where ``action_mask`` is 1 (0
    elsewhere)."""
    prompt_ids = fit_width(prompt_ids, prompt_width, pad_id, left=True)
    prompt_mask = fit_width(prompt_mask, prompt_width, 0, left=True)
    ensure_synced(engine, actor)
    seeds = [sample_seed(run_seed, int(s)) for s in sample_ids] if do_sample else None
    sampling = SamplingSpec(answer_len, eos_id, seeds, temperature, top_k)
    error: BaseException | None = None
    gens = None
    try:
        gens = group_generate(engine, engine.group, _unpadded(prompt_ids, prompt_mask), sampling)
    except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
        error = exc
    if engine.group is not None and engine.group.world_size > 1:  # peers may be blocked in vLLM's collectives
        error = settle_group_call(engine, error)
    actor.comm.agree(error, "vLLM generation", phase="rollout")
    assert gens is not None
    rows = len(gens.tokens)
    generated = torch.full((rows, max(1, answer_len)), pad_id, dtype=prompt_ids.dtype)
    sampled = torch.zeros(rows, max(1, answer_len), dtype=torch.float32)
    for i, (toks, lps) in enumerate(zip(gens.tokens, gens.logprobs or [[]] * rows)):
        n = min(len(toks), answer_len)
        generated[i, :n] = torch.tensor(toks[:n], dtype=prompt_ids.dtype)
        if lps:
            sampled[i, :n] = torch.tensor(lps[:n], dtype=torch.float32)
    device = prompt_ids.device
    ro = lay_out(
        prompt_ids, prompt_mask, generated.to(device), answer_len=answer_len, pad_id=pad_id, eos_id=eos_id, stop=stop
    )
    width = ro.prompt_width
    logprobs = torch.zeros(rows, ro.sequences.shape[1] - 1, dtype=torch.float32, device=device)
    logprobs[:, width - 1 :] = sampled[:, :answer_len].to(device) * ro.action_mask[:, width - 1 :]
    return ro, logprobs

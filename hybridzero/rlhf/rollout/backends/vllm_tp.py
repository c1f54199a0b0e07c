"""vLLM rollouts with tensor parallelism (``inference_tp_size`` t > 1 with ``rollout_engine = "vllm"``).

Groups of ``t`` consecutive ranks (ranks ``[k t, (k+1) t)``, the layout of the hf path's
:mod:`hybridzero.runtime.tp_generate` and the one vLLM's ``external_launcher`` builds its tensor-parallel groups in)
share one vLLM engine: every rank of the group holds ``1/t`` of the model and runs the same scheduler on the same
requests, so all of them compute the same tokens. One call of :func:`group_generate`:

1. one ``all_gather_object`` of metadata in the group (row count, longest prompt, the sampling fields other than the
   seeds): fields that differ within the group raise on every rank of the group, naming the field;
2. one tensor all-gather of every rank's prompts and per-sample seeds (ledger label ``"vllm_prompts"``, group
   ``"vllm_tp"``), joined in group-rank order;
3. the group's engine generates the joint batch, each prompt with its own seed (so a sample's answer depends on its
   seed and the weights only, never on the rank or the group it sits in);
4. each rank takes back its own rows, in its own order.

Invariant: every rank of a group calls :func:`group_generate` the same number of times, with the same sampling
fields. Failures that come from the inputs are the same on every rank of the group, since every rank runs the same
requests; a failure inside vLLM's decode on *one* rank leaves its peers blocked in vLLM's own tensor-parallel
collectives, which nothing can interrupt: the caller (``vllm_rollout``) then gives the job up instead of waiting
(:mod:`~hybridzero.rlhf.rollout.backends.tp_failure`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from transformers import PretrainedConfig

from hybridzero.comm.collectives import Comm
from hybridzero.rlhf.rollout.backends.base import Generations, RolloutEngine, SamplingSpec

__all__ = ["TP_COMM_NAME", "group_generate", "valid_tp_sizes", "vllm_tp_problem"]

TP_COMM_NAME = "vllm_tp"
_PHASE = "rollout"


def _split_counts(config: PretrainedConfig) -> dict[str, int]:
    """The dimensions vLLM's tensor parallelism splits: query heads, kv heads and the MLP width."""
    heads = int(config.num_attention_heads)
    kv = getattr(config, "num_key_value_heads", None)
    counts = {"num_attention_heads": heads, "num_key_value_heads": int(kv) if kv else heads}
    width = getattr(config, "intermediate_size", None)
    if isinstance(width, int) and width > 0:
        counts["intermediate_size"] = width
    return counts


def _splits(counts: dict[str, int], tp: int) -> list[str]:
    """The names of ``counts`` that ``tp`` ranks cannot split (kv heads: one of the two divides the other)."""
    bad = []
    for name, n in counts.items():
        ok = n % tp == 0 or (name == "num_key_value_heads" and tp % n == 0)
        if not ok:
            bad.append(f"{name} = {n}")
    return bad


def valid_tp_sizes(config: PretrainedConfig, world_size: int) -> list[int]:
    """The tensor-parallel sizes vLLM can run ``config`` with at ``world_size`` ranks (pure; 1 always)."""
    counts = _split_counts(config)
    return [t for t in range(1, world_size + 1) if world_size % t == 0 and not _splits(counts, t)]


def vllm_tp_problem(config: PretrainedConfig, tp: int, world_size: int) -> str | None:
    """Why ``inference_tp_size = tp`` cannot run ``config`` on vLLM at ``world_size`` ranks (one line naming the
    value and the sizes that would work), or ``None`` (pure)."""
    if tp == 1:
        return None
    where = f"inference_tp_size = {tp} with rollout_engine = 'vllm'"
    valid = ", ".join(map(str, valid_tp_sizes(config, world_size)))
    if world_size % tp:
        return (
            f"{where} does not divide the world size {world_size} (groups of {tp} consecutive ranks share one "
            f"engine); valid: {valid}"
        )
    bad = _splits(_split_counts(config), tp)
    if bad:
        name = type(config).__name__.removesuffix("Config") or "the model"
        return f"{where} cannot split {name}'s {', '.join(bad)} over {tp} ranks; valid here: {valid}"
    return None


def _sampling_key(sampling: SamplingSpec) -> dict[str, object]:
    """The sampling fields every rank of a group must share (all but the per-sample seeds)."""
    return {
        "max_new_tokens": sampling.max_new_tokens,
        "eos_id": sampling.eos_id,
        "sampled": sampling.seeds is not None,
        "temperature": sampling.temperature,
        "top_k": sampling.top_k,
    }


def _mismatch(keys: list[dict[str, object]]) -> str | None:
    """The first sampling field that differs within the group (pure; every rank finds the same answer)."""
    for rank, other in enumerate(keys[1:], start=1):
        for name, value in keys[0].items():
            if other[name] != value:
                return (
                    f"vLLM tensor-parallel generation: {name} differs within a group (group rank 0: {value}, group "
                    f"rank {rank}: {other[name]}); the ranks of an inference_tp_size group generate one joint batch"
                )
    return None


def _joint(
    group: Comm, prompts: Sequence[Sequence[int]], seeds: Sequence[int] | None, sizes: list[int], width: int
) -> tuple[list[list[int]], list[int]]:
    """Every rank's prompts and seeds in group-rank order: one all-gather of ``[Bmax, 2 + width]`` rows (length,
    seed, the prompt's tokens zero-padded)."""
    bmax = max(sizes)
    mine = torch.zeros(bmax, 2 + width, dtype=torch.int64)
    for i, p in enumerate(prompts):
        mine[i, 0] = len(p)
        mine[i, 1] = 0 if seeds is None else int(seeds[i])
        mine[i, 2 : 2 + len(p)] = torch.tensor([int(x) for x in p], dtype=torch.int64)
    got = torch.empty(len(sizes) * bmax, 2 + width, dtype=torch.int64)
    group.all_gather(got, mine, phase=_PHASE, label="vllm_prompts")
    rows = [got[k * bmax + i] for k, n in enumerate(sizes) for i in range(n)]
    return [r[2 : 2 + int(r[0])].tolist() for r in rows], [int(r[1]) for r in rows]


def group_generate(
    engine: RolloutEngine, group: Comm | None, prompts: Sequence[Sequence[int]], sampling: SamplingSpec
) -> Generations:
    """This rank's answers for ``prompts`` when its tensor-parallel group's engine generates the group's prompts
    together (module docstring); ``group`` ``None`` (or of one rank): the engine's own :meth:`generate`.
    Collective over ``group``; a differing sampling field raises ``ValueError`` on every rank of the group."""
    if group is None or group.world_size == 1:
        return engine.generate(prompts, sampling)
    key = _sampling_key(sampling)
    metas = group.all_gather_object((len(prompts), max(map(len, prompts), default=0), key), phase=_PHASE)
    problem = _mismatch([m[2] for m in metas])
    if problem is not None:
        raise ValueError(problem)
    sizes = [int(m[0]) for m in metas]
    if sum(sizes) == 0:
        return Generations([], [])
    joint, seeds = _joint(group, prompts, sampling.seeds, sizes, max(int(m[1]) for m in metas))
    gens = engine.generate(joint, replace(sampling, seeds=seeds if sampling.seeds is not None else None))
    lo = sum(sizes[: group.rank])
    hi = lo + len(prompts)
    return Generations(gens.tokens[lo:hi], None if gens.logprobs is None else gens.logprobs[lo:hi])

"""Rollouts under sequence parallelism: generation split by sample over the SP group, the rows all-gathered back.

The ``s`` ranks of an SP group (``sequence_parallel_size`` s > 1 in ``ppo`` / ``grpo``) share their data rank's
``n`` samples (prompt rows with their sample ids). A decode step has one token, which cannot be split by sequence,
so the group splits the *samples*: SP rank ``r`` generates the contiguous share ``[lo_r, hi_r)`` of
:func:`share_bounds` (``ceil(n / s)`` samples each; the last shares shorter, possibly empty) with whatever rollout
engine the run uses, then every row field of its rollout (token ids, masks, finished flags, the sampler's log-probs
where vLLM gives them) is all-gathered over the SP group (``Comm.all_gather`` on ``sp.comm``: ledger label
:data:`ROWS_LABEL`, group ``"sp"``, phase ``"rollout"``) and the shares are joined in SP-rank order, which is
sample order (:func:`join_shares`).

Invariants:

* every rank of the group ends with bitwise-identical rows (an all-gather returns the same bytes to every rank),
  laid out exactly as one rank generating all ``n`` samples lays them out (fixed ``[P + A]`` rows,
  :class:`~hybridzero.rlhf.rollout.generate.Rollout`), in the data rank's sample order;
* each sample's answer depends only on its own seed and logits (:mod:`hybridzero.rlhf.rollout.generate`; vLLM's
  per-request seeds): which rank generates it changes nothing beyond the batch's composition (the rounding of its
  logits);
* every rank generates at least one row: an empty share generates a placeholder (its data rank's first sample),
  dropped before the gather (:func:`generated_rows`), so HF ``generate``, ZeRO-3's synced decode and a
  tensor-parallel group's joint batch never see an empty batch, and every rank makes the same calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from hybridzero.comm.collectives import Comm
from hybridzero.rlhf.rollout.generate import Rollout

__all__ = ["ROWS_LABEL", "gather_rollout", "gather_rows", "generated_rows", "join_shares", "share_bounds"]

ROWS_LABEL = "sp_rollout_rows"


def share_bounds(n: int, size: int) -> list[tuple[int, int]]:
    """``[lo_r, hi_r)`` of each of ``size`` ranks over ``n`` samples: contiguous, in rank order, ``ceil(n / size)``
    each but the last ones (shorter or empty); together exactly ``range(n)`` (pure)."""
    if n < 0 or size < 1:
        raise ValueError(f"share_bounds(n = {n}, size = {size}): need n >= 0 and size >= 1")
    per = -(-n // size)
    return [(min(r * per, n), min((r + 1) * per, n)) for r in range(size)]


def generated_rows(n: int, size: int, rank: int) -> list[int]:
    """The sample indices SP rank ``rank`` generates out of its data rank's ``n``: its share, or ``[0]`` (a
    placeholder whose row is dropped before the gather) when the share is empty (pure; ``n >= 1``)."""
    if n < 1:
        raise ValueError(f"a rollout of n = {n} samples: every SP group generates at least one sample")
    lo, hi = share_bounds(n, size)[rank]
    return list(range(lo, hi)) or [0]


def join_shares(gathered: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> torch.Tensor:
    """``gathered [s * per, ...]`` (each rank's share padded to ``per`` rows, rank-major) -> ``[n, ...]``, the
    shares' real rows in rank order, i.e. sample order (pure)."""
    per = gathered.shape[0] // len(bounds)
    return torch.cat([gathered[k * per : k * per + hi - lo] for k, (lo, hi) in enumerate(bounds)])


def gather_rows(comm: Comm, t: torch.Tensor, kept: int, bounds: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The first ``kept`` rows of ``t`` (this rank's share; a placeholder row beyond them is dropped) all-gathered
    over ``comm`` and joined in sample order; same dtype and device as ``t`` (one counted all-gather; bool travels
    as int64, as gloo takes it)."""
    per = max(hi - lo for lo, hi in bounds)
    wire = torch.long if t.dtype == torch.bool else t.dtype
    send = torch.zeros((per, *t.shape[1:]), dtype=wire, device=t.device)
    send[:kept] = t[:kept].to(wire)
    recv = torch.empty((len(bounds) * per, *t.shape[1:]), dtype=wire, device=t.device)
    comm.all_gather(recv, send, phase="rollout", label=ROWS_LABEL)
    return join_shares(recv, bounds).to(t.dtype)


def gather_rollout(
    comm: Comm, ro: Rollout, sampler: torch.Tensor | None, n: int
) -> tuple[Rollout, torch.Tensor | None]:
    """The SP group's whole rollout of ``n`` samples from this rank's share ``ro`` (and the sampler's log-probs
    ``sampler [rows, P+A-1]`` where given): every row field gathered (module docstring). Every rank of ``comm``
    calls it with the same ``n`` and the same presence of ``finished`` / ``sampler``."""
    bounds = share_bounds(n, comm.world_size)
    lo, hi = bounds[comm.rank]

    def rows(t: torch.Tensor) -> torch.Tensor:
        return gather_rows(comm, t, hi - lo, bounds)

    whole = replace(
        ro,
        sequences=rows(ro.sequences),
        attention_mask=rows(ro.attention_mask),
        action_mask=rows(ro.action_mask),
        finished=rows(ro.finished) if ro.finished is not None else None,
    )
    return whole, rows(sampler) if sampler is not None else None

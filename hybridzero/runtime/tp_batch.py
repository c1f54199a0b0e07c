"""The joint batch of a tensor-parallel group (pure functions) and the logits processor that keeps rows their own.

The ``t`` ranks of a group decode one batch: each rank's prompts ``[B_r, L_r]`` are left-padded to the group's
widest ``L`` (masked, so positions and attention are those of the rank's own prompt) and stacked in group-rank order.
Afterwards rank ``r`` takes back its rows, without the extra padding and cut to the length its own ``generate``
would have returned (HF stops a batch once every row has produced an EOS): :func:`own_rows`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hybridzero.comm.collectives import Comm


def default_attention_mask(ids: torch.Tensor, pad: int | None, eos: Sequence[int]) -> torch.Tensor:
    """The mask HF ``generate`` infers when none is given: ``ids != pad`` if the pad token occurs and is not an EOS
    token, else all ones (pure)."""
    if pad is not None and bool((ids == pad).any()) and pad not in eos:
        return ids.ne(pad).long()
    return torch.ones_like(ids, dtype=torch.long)


def pad_left(t: torch.Tensor, width: int, rows: int, value: int) -> torch.Tensor:
    """``t [B, n]`` left-padded with ``value`` to ``[rows, width]`` (extra rows at the bottom; pure)."""
    out = torch.full((rows, width), value, dtype=t.dtype, device=t.device)
    out[: t.shape[0], width - t.shape[1] :] = t
    return out


def join_rows(gathered: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """Rows of ``gathered [t * Bmax, ...]`` (every rank's block padded to ``Bmax``) that are real, in rank order."""
    bmax = gathered.shape[0] // len(sizes)
    return torch.cat([gathered[k * bmax : k * bmax + n] for k, n in enumerate(sizes)])


def own_rows(joint: torch.Tensor, lo: int, hi: int, width: int, own_width: int, eos: Sequence[int]) -> torch.Tensor:
    """This rank's result from the group's output ``joint [sum B, width + n]``: rows ``[lo, hi)``, the prompt at its
    own width, and as many generated tokens as its own batch would have produced: up to the last of its rows' first
    EOS, or all ``n`` when some row has none (pure)."""
    rows = joint[lo:hi]
    generated = rows[:, width:]
    n = generated.shape[1]
    keep = 0 if rows.shape[0] == 0 else n
    if eos and rows.shape[0] > 0 and n > 0:
        is_eos = torch.isin(generated, torch.tensor(list(eos), device=generated.device))
        first = torch.where(
            is_eos.any(1), is_eos.int().argmax(1) + 1, torch.full_like(is_eos[:, 0], n, dtype=torch.long)
        )
        keep = int(first.max())
    return rows[:, width - own_width : width + keep]


class OwnRowsProcessor:
    """A logits processor for the joint batch: each rank applies its own ``processors`` (e.g. the rollout's per-row
    sampling noise) to its own rows, seen exactly as in its own ``generate`` (its input ids at its own width), and one
    all-gather over the group gives every rank the same processed scores for all rows (so every rank picks the same
    tokens and the group stays in step). Called once per decode step on every rank of the group."""

    def __init__(self, processors: Any, comm: Comm, sizes: Sequence[int], width: int, own_width: int) -> None:
        self.processors = processors
        self.comm = comm
        self.sizes = list(sizes)
        self.lo = sum(self.sizes[: comm.rank])
        self.hi = self.lo + self.sizes[comm.rank]
        self.offset = width - own_width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """``[sum B, V]`` scores -> the same shape, every row processed by its own rank."""
        mine = scores[self.lo : self.hi]
        if self.processors is not None and mine.shape[0] > 0:
            mine = self.processors(input_ids[self.lo : self.hi, self.offset :], mine)
        bmax = max(self.sizes)
        send = torch.zeros((bmax, scores.shape[1]), dtype=torch.float32, device=scores.device)
        send[: mine.shape[0]] = mine.float()
        recv = torch.empty((len(self.sizes) * bmax, scores.shape[1]), dtype=torch.float32, device=scores.device)
        self.comm.all_gather(recv, send, phase="generate", label="tp_scores")
        return join_rows(recv, self.sizes)

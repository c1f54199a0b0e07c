"""Packed rows under Ulysses sequence parallelism: one rank's slice of a packed batch, and the full row's mask.

A packed row (:mod:`hybridzero.packing`) holds several sequences; under sequence parallelism of size ``s`` rank
``r`` holds positions ``[r W/s, (r+1) W/s)`` of every row, and after the first all-to-all every rank attends over
the whole row with ``H / s`` heads (:mod:`hybridzero.runtime.ulysses`). So every rank of the SP group gets:

* its slice of ``input_ids`` and of the **per-sequence** ``position_ids`` (restarting at 0 at every sequence start,
  as unpacked: rotary and learned position embeddings read what they read unpacked);
* the block-causal mask of the **whole** (padded) row, ``[R, 1, W', W']`` (:func:`~hybridzero.packing.
  block_causal_mask`): a token sees only earlier tokens of its own sequence; the Ulysses attention uses it in place
  of its causal mask. It is the same tensor on every rank and costs ``R W'^2`` elements (as the causal mask it
  replaces costs ``W'^2``);
* its slice of the next-token targets ``shift_labels``, shifted on the whole row before the split; a target that
  would cross into the next sequence (or into padding) is ignored, so the predicted (position, label) pairs are
  exactly those of the unpacked batch.

``W`` is right-padded to ``W'``, a multiple of ``s``, with padding slots (segment ``-1``, position 0, target
ignored; each sees only itself). Every rank of an SP group must pass the same packed batch. Pure functions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridzero.packing import PackedBatch, block_causal_mask

IGNORE_INDEX = -100

__all__ = ["packed_targets", "shard_packed"]


def _pad(t: torch.Tensor, extra: int, value: int) -> torch.Tensor:
    return F.pad(t, (0, extra), value=value) if extra else t


def packed_targets(packed: PackedBatch, labels: torch.Tensor | None) -> torch.Tensor:
    """``[R, W]`` next-token targets of packed rows: slot ``t`` predicts ``labels[t + 1]`` when slot ``t + 1`` is a
    real token of the same sequence, else ``IGNORE_INDEX``. ``labels`` is HF's convention (``[R, W]``, the label of
    each slot; :func:`~hybridzero.packing.shifted_labels`); None: the tokens themselves."""
    ids, seg = packed.input_ids, packed.segments
    lab = ids if labels is None else labels.to(ids.device)
    if lab.shape != ids.shape:
        raise ValueError(f"packed labels must have the packed rows' shape {tuple(ids.shape)}, got {tuple(lab.shape)}")
    same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] >= 0)
    targets = torch.full_like(lab, IGNORE_INDEX)
    targets[:, :-1] = torch.where(same, lab[:, 1:], torch.full_like(lab[:, 1:], IGNORE_INDEX))
    return targets


def shard_packed(
    packed: PackedBatch,
    rank: int,
    size: int,
    labels: torch.Tensor | None = None,
    pad_token_id: int = 0,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s slice (of ``size``) of a packed batch: ``input_ids``, ``position_ids`` and ``shift_labels``
    ``[R, W'/s]`` and the whole row's ``attention_mask`` ``[R, 1, W', W']`` (additive, ``dtype``). The model takes
    ``input_ids``, ``position_ids`` and ``attention_mask``; ``SequenceParallel.loss`` takes ``shift_labels``."""
    width = packed.input_ids.shape[1]
    if width < size:
        raise ValueError(
            f"packed rows of {width} slots are shorter than sequence_parallel_size = {size}: every rank needs at "
            f"least one position; pack rows of >= {size} tokens or use a smaller sequence_parallel_size"
        )
    extra = -width % size
    ids = _pad(packed.input_ids, extra, pad_token_id)
    positions = _pad(packed.position_ids, extra, 0)
    segments = _pad(packed.segments, extra, -1)
    targets = _pad(packed_targets(packed, labels), extra, IGNORE_INDEX)
    local = (width + extra) // size
    lo, hi = rank * local, (rank + 1) * local
    return {
        "input_ids": ids[:, lo:hi],
        "position_ids": positions[:, lo:hi],
        "attention_mask": block_causal_mask(segments, dtype),
        "shift_labels": targets[:, lo:hi],
    }

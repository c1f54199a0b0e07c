"""DeepSpeed's ``UlyssesSPDataLoaderAdapter`` behaviour on hybridzero: a data loader wrapper that shards every batch's
sequence over the sequence-parallel (SP) group.

Each of the ``s`` ranks of an SP group draws its own batch from the wrapped loader; the group gathers the ``s``
batches and then trains on them one after the other, all ranks together: the ``j``-th micro-batch yielded on rank
``r`` is slice ``r`` of rank ``j``'s batch (so one pass over the wrapped loader is ``s`` times as many micro-batches,
and ``len`` says so). Per batch ``[B, L]``:

* ``position_ids`` are the global positions ``0 .. L-1`` when the batch has none. Given ones may restart inside a row
  (packed rows, e.g. from ``DataCollatorWithFlattening``): as in Hugging Face, a position that does not count on by
  one from its left neighbour starts a new sequence. A packed batch then also gets ``attention_mask``, the boolean
  block-causal mask ``[B, 1, L, L]`` of the whole (padded) row, the same on every rank (a token sees only earlier
  tokens of its own sequence; the Ulysses attention uses it in place of its causal mask), and a target that would
  cross into the next sequence is ignored;
* ``L`` is right-padded to a multiple of ``s``: ``input_ids`` with ``pad_token_id``, ``labels`` with ``-100``,
  ``position_ids`` counting on, other sequence tensors with 0;
* ``labels`` are replaced by ``shift_labels`` (position ``t`` predicts ``labels[t + 1]``; the last position ``-100``),
  shifted on the whole row before the split, so slice ``r``'s last position predicts slice ``r + 1``'s first token
  and the per-token loss summed over the slices is the unsplit loss;
* every tensor whose first two dimensions are ``[B, L]`` is cut to the slice ``[r L/s, (r+1) L/s)``; other values
  are passed on whole. Yielded tensors are on the CPU (as DeepSpeed queues them); the caller moves them.

``attention_mask`` may only mark right padding (whose labels the collator sets to ``-100``): the attention is causal
over the whole row (block-causal for packed rows) and ignores a 2D mask, so left padding or holes would be attended;
they are refused.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from hybridzero import comm as dist  # deepspeed.comm's face: torch.distributed's own functions, re-exported

IGNORE_INDEX = -100

__all__ = ["UlyssesDataLoaderAdapter", "move_to_device", "packed_segments", "shard_gathered"]


def _checked_batch(batch: Any) -> dict[str, Any]:
    """``batch`` as a new dict with ``position_ids``; raises naming the key on what cannot be sharded (pure)."""
    if not isinstance(batch, dict) or not torch.is_tensor(batch.get("input_ids")) or batch["input_ids"].ndim != 2:
        raise ValueError("Ulysses SP batches must be dicts with a tensor input_ids of shape [batch, sequence]")
    ids = batch["input_ids"]
    labels = batch.get("labels")
    if not torch.is_tensor(labels) or labels.shape[:2] != ids.shape:
        raise ValueError(f"Ulysses SP batches need tensor labels of input_ids' shape {tuple(ids.shape)}")
    out = dict(batch)
    positions = out.get("position_ids")
    if positions is None:
        out["position_ids"] = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1).clone()
    elif not torch.is_tensor(positions) or positions.shape != ids.shape:
        raise ValueError(
            f"position_ids must be a tensor of input_ids' shape {tuple(ids.shape)} under Ulysses sequence parallelism"
        )
    mask = out.get("attention_mask")
    if torch.is_tensor(mask) and bool((mask[:, 1:] > mask[:, :-1]).any()):
        raise ValueError(
            "attention_mask with left padding (or holes) is not supported with Ulysses sequence parallelism: the "
            "attention is causal over the whole row; pad on the right (with labels -100)"
        )
    return out


def _pad(key: str, t: torch.Tensor, extra: int, pad_token_id: int) -> torch.Tensor:
    """Sequence tensor ``t`` ``[B, L, ...]`` right-padded by ``extra`` positions along dim 1 (pure)."""
    if key == "position_ids":
        return torch.cat([t, t[:, -1:] + torch.arange(1, extra + 1, dtype=t.dtype, device=t.device)], dim=1)
    value = IGNORE_INDEX if key in ("labels", "shift_labels") else pad_token_id if key == "input_ids" else 0
    return F.pad(t, (0, 0) * (t.ndim - 2) + (0, extra), value=value)


def packed_segments(positions: torch.Tensor) -> torch.Tensor | None:
    """``[B, L]`` sequence index of every position when some row's ``positions`` restart (a position that is not
    its left neighbour's plus one starts a sequence), else None (pure)."""
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    if not bool(starts[:, 1:].any()):
        return None
    return starts.long().cumsum(dim=1)


def _block_causal(segments: torch.Tensor) -> torch.Tensor:
    """``[B, 1, L, L]`` boolean: query ``i`` may see key ``j`` iff ``j <= i`` in the same sequence (pure)."""
    length = segments.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segments.device).tril()
    return ((segments[:, :, None] == segments[:, None, :]) & causal)[:, None]


def shard_gathered(batch: dict[str, Any], rank: int, size: int, pad_token_id: int = 0) -> dict[str, Any]:
    """Slice ``rank`` of ``size`` of one whole (checked) batch, with ``shift_labels`` instead of ``labels`` (pure;
    the module docstring says how)."""
    ids = batch["input_ids"]
    rows, length = ids.shape
    if length < size:
        raise ValueError(f"sequence length {length} is shorter than the sequence parallel size {size}")
    extra = -length % size
    seq_keys = [
        k for k, v in batch.items() if torch.is_tensor(v) and v.ndim >= 2 and tuple(v.shape[:2]) == (rows, length)
    ]
    out = dict(batch)
    labels = out.pop("labels")
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, :-1] = labels[:, 1:]
    segments = packed_segments(out["position_ids"])
    if segments is not None:  # packed rows: no target crosses into the next sequence; the whole row's mask
        shifted[:, :-1] = shifted[:, :-1].masked_fill(segments[:, 1:] != segments[:, :-1], IGNORE_INDEX)
        if extra:  # the padding continues each row's last sequence (its targets are ignored)
            segments = torch.cat([segments, segments[:, -1:].expand(-1, extra)], dim=1)
        out["attention_mask"] = _block_causal(segments).cpu()  # replaces a 2D mask (right padding only, checked)
        seq_keys = [k for k in seq_keys if k != "attention_mask"]
    out["shift_labels"] = shifted
    seq_keys = [k if k != "labels" else "shift_labels" for k in seq_keys]
    local = (length + extra) // size
    for key in seq_keys:
        t = _pad(key, out[key], extra, pad_token_id) if extra else out[key]
        out[key] = t[:, rank * local : (rank + 1) * local].cpu().contiguous()
    return out


def _gather_tensor(t: torch.Tensor, group: Any, size: int) -> list[torch.Tensor]:
    shapes: list[Any] = [None] * size
    dist.all_gather_object(shapes, tuple(t.shape), group=group)
    got = [torch.empty(shape, dtype=t.dtype, device=t.device) for shape in shapes]
    dist.all_gather(got, t.contiguous(), group=group)
    return got


class UlyssesDataLoaderAdapter:
    """Iterates ``dl`` sharded over the SP group (module docstring). Every rank of the group iterates together (each
    refill is a collective over ``sp_group``); the wrapped loader restarts after it is exhausted, for the next epoch."""

    def __init__(
        self,
        dl: Iterable[Any],
        sp_rank: int,
        sp_group: Any,
        sp_world_size: int,
        device: Any,
        pad_to_sp_multiple: bool = True,
        pad_token_id: int = 0,
    ) -> None:
        self.dl = dl
        self.sp_rank = sp_rank
        self.sp_group = sp_group
        self.sp_world_size = sp_world_size
        self.device = device
        self.pad_to_sp_multiple = pad_to_sp_multiple
        self.pad_token_id = pad_token_id
        self.iter: Iterator[Any] = iter(dl)
        self.micro_batches: deque[dict[str, Any]] = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size  # type: ignore[arg-type]

    def __iter__(self) -> UlyssesDataLoaderAdapter:
        return self

    def __next__(self) -> dict[str, Any]:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        """Draw one batch, gather the group's ``s`` batches and queue this rank's slice of each."""
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)
            raise
        batch = _checked_batch(batch)
        if not self.pad_to_sp_multiple and batch["input_ids"].shape[1] % self.sp_world_size:
            raise ValueError(
                f"sequence length {batch['input_ids'].shape[1]} is not a multiple of the sequence parallel size "
                f"{self.sp_world_size} and pad_to_sp_multiple is False"
            )
        size = self.sp_world_size
        per_rank: list[dict[str, Any]] = [{} for _ in range(size)]
        for key, value in batch.items():
            if torch.is_tensor(value):
                parts: list[Any] = _gather_tensor(value.to(self.device), self.sp_group, size)
            else:
                parts = [None] * size
                dist.all_gather_object(parts, value, group=self.sp_group)
            for j, part in enumerate(parts):
                per_rank[j][key] = part
        for whole in per_rank:
            self.micro_batches.append(shard_gathered(whole, self.sp_rank, size, self.pad_token_id))


def move_to_device(item: Any, device: Any) -> Any:
    """``item`` with every tensor in it (through dicts, lists and tuples) moved to ``device``; other values as they are
    (DeepSpeed's ``runtime.utils.move_to_device``)."""
    if torch.is_tensor(item):
        return item.to(device)
    if isinstance(item, dict):
        return {k: move_to_device(v, device) for k, v in item.items()}
    if isinstance(item, (list, tuple)):
        return type(item)(move_to_device(v, device) for v in item)
    return item

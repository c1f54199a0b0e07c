"""Token-budgeted packed forwards (``--max_tokens_per_batch N``): a micro-batch is a number of tokens.

The sequences of one micro-batch (SFT) or one training mini-batch (RL) are split into chunks of at most ``N`` real
tokens (:func:`~hybridzero.packing.token_budget_chunks`, first-fit-decreasing); each chunk is packed into one row
of at most ``N`` slots, forwarded and (when training) backwarded on its own, so activation memory is bounded by
``N`` tokens whatever the micro-batch's size.

Invariants:

* **Same loss.** A chunk's loss is scaled so that the *sum* over chunks is the whole micro-batch's loss as computed
  unpacked (callers pass the whole micro-batch's normaliser); the backwards of one micro-batch run inside
  :meth:`Engine.backward_group`, so the engine counts one micro-step and the gradients are those of one backward.
* **Same number of forwards on every rank.** ZeRO-3 forwards and backwards are collective, so every rank runs the
  largest chunk count of any rank (one MAX all-reduce); a rank with fewer chunks runs stand-in chunks (its first
  sequence) whose outputs are discarded and whose losses are weighted 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hybridzero.packed_forward import packed_lm_sums
from hybridzero.packing import token_budget_chunks

__all__ = [
    "Chunk",
    "budget_chunks",
    "budget_lm_backward",
    "budget_lm_sums",
    "chunked_rows",
    "maybe_chunked",
    "row_chunks",
]


@dataclass(frozen=True)
class Chunk:
    """Row indices of one forward and its loss weight (1 for a real chunk, 0 for a stand-in)."""

    rows: list[int]
    weight: float


def budget_chunks(engine: Any, lengths: Sequence[int], max_tokens: int, unit: str = "sequence") -> list[Chunk]:
    """This rank's chunks of ``lengths`` under ``max_tokens``, padded with stand-ins to the count of every rank
    (``unit`` names what a length measures, for the error of one over the budget)."""
    plan = token_budget_chunks(lengths, max_tokens, unit)
    count = torch.tensor([float(len(plan))], dtype=torch.float64, device=engine.device)
    engine.comm.all_reduce(count, op="max", phase="metrics")
    chunks = [Chunk(rows, 1.0) for rows in plan]
    stand_in = Chunk([0], 0.0)  # every rank has >= 1 sequence in a micro-batch
    return chunks + [stand_in] * (int(count.item()) - len(plan))


def row_chunks(engine: Any, attention_mask: torch.Tensor, max_tokens: int | None) -> list[Chunk]:
    """The chunks of a padded batch's rows: all rows in one chunk without a budget, else :func:`budget_chunks`."""
    if max_tokens is None:
        return [Chunk(list(range(attention_mask.shape[0])), 1.0)]
    return budget_chunks(engine, [int(n) for n in attention_mask.bool().sum(dim=1).tolist()], max_tokens)


def chunked_rows(
    engine: Any,
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    max_tokens: int,
) -> torch.Tensor:
    """``forward(sequences[rows], attention_mask[rows])`` per chunk of a padded batch, reassembled in batch order
    (``[B, ...]``; the per-row results are what one forward of the whole batch gives, up to summation order)."""
    lengths = [int(n) for n in attention_mask.bool().sum(dim=1).tolist()]
    out: torch.Tensor | None = None
    for chunk in budget_chunks(engine, lengths, max_tokens):
        rows = torch.tensor(chunk.rows, dtype=torch.long, device=sequences.device)
        part = forward(sequences[rows], attention_mask[rows])
        if chunk.weight == 0.0:
            continue
        if out is None:
            out = part.new_zeros((sequences.shape[0], *part.shape[1:]))
        out[rows.to(part.device)] = part
    if out is None:
        raise ValueError("chunked_rows: an empty batch has no rows to forward")
    return out


def maybe_chunked(
    engine: Any,
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    max_tokens: int | None,
) -> torch.Tensor:
    """``forward(sequences, attention_mask)`` once without a budget, else by :func:`chunked_rows`."""
    if max_tokens is None:
        return forward(sequences, attention_mask)
    return chunked_rows(engine, forward, sequences, attention_mask, max_tokens)


def budget_lm_backward(
    engine: Any,
    examples: Sequence[tuple[Sequence[int], Sequence[int]]],
    pad_id: int,
    max_tokens: int,
    ignore_index: int = -100,
    scale: float = 1.0,
) -> tuple[float, int, int]:
    """Forward and backward of a causal-LM micro-batch in chunks of ``<= max_tokens`` tokens; returns ``(loss,
    real_tokens, slots)`` like :func:`~hybridzero.packed_forward.packed_lm_loss`, the loss already backwarded.

    Each chunk's loss is its summed cross-entropy over the micro-batch's label-token count (HF's token mean,
    unpacked), so the chunks' losses sum to the micro-batch's loss. Backwards run in one ``backward_group``. Under
    sequence parallelism each chunk's row is split over the SP group (:func:`~hybridzero.packed_forward.
    packed_lm_sums`); every rank of a group passes the same examples, so the group plans the same chunks.
    ``scale`` multiplies what is backwarded (e.g. ptx's ``coef`` and global token weighting), not the returned loss.
    """
    lengths = [len(e[0]) for e in examples]
    n_labels = sum(sum(1 for y in e[1][1:] if y != ignore_index) for e in examples)
    total, real, slots = 0.0, 0, 0
    with engine.backward_group():
        for chunk in budget_chunks(engine, lengths, max_tokens):
            part = [examples[i] for i in chunk.rows]
            nll, _, packed = packed_lm_sums(engine, part, pad_id, capacity=max_tokens)
            loss = nll * (chunk.weight / max(n_labels, 1))
            engine.backward(loss * scale)
            total += float(loss.detach())
            real += int(chunk.weight) * packed.token_count()
            slots += int(chunk.weight) * int(packed.input_ids.numel())
    return total, real, slots


def budget_lm_sums(
    engine: Any, examples: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int, max_tokens: int
) -> tuple[float, float]:
    """``(summed next-token cross-entropy, label-token count)`` of causal-LM ``examples``, forwarded (no backward:
    evaluation) in packed chunks of ``<= max_tokens`` tokens; the same sums as one forward of them all, up to
    summation order. Every rank runs the same number of chunk forwards (stand-ins count 0)."""
    nll, count = 0.0, 0.0
    for chunk in budget_chunks(engine, [len(e[0]) for e in examples], max_tokens):
        part_nll, part_count, _ = packed_lm_sums(engine, [examples[i] for i in chunk.rows], pad_id, capacity=max_tokens)
        nll += chunk.weight * float(part_nll)
        count += chunk.weight * float(part_count)
    return nll, count

"""Sample packing: variable-length sequences concatenated into rows, attention kept inside each sequence.

Pure functions, no model and no process group. A batch's sequences (the real tokens of each row of a padded
``[B, T]`` batch, or a list of token lists) are placed into ``R`` rows of width ``W`` by first-fit-decreasing
into bins of ``capacity`` tokens (:func:`plan_rows`' default: the longest sequence, so a row is never wider than the
padded batch; the training forwards pass :func:`cheapest_capacity`'s choice of 1-2x that, trading padding against
dense-mask attention width). Each packed token keeps:

* its **position** inside its own sequence (0, 1, ... restarting at every sequence start): rotary (Llama) and learned
  (OPT, GPT-2) position embeddings read exactly what they read unpacked;
* its **segment** (the index of its sequence in the batch; ``-1`` on the padding at a row's end);
* an **attention mask** ``[R, 1, W, W]``, additive float (0 where allowed, the dtype's minimum elsewhere):
  token ``i`` sees token ``j`` iff both are in the same segment and ``j <= i`` (a padding slot sees only itself, so
  no softmax row is empty). Hugging Face models use a 4D mask as given, for ``eager`` and ``sdpa`` alike.
  Position ids alone do not isolate sequences in those paths (measured: the second sequence's logits move); the
  block-causal mask does.

Flash attention takes no dense mask: :func:`varlen_kwargs` gives Hugging Face's padding-free format instead (the
rows flattened into one ``[1, R * W]`` row, per-sequence positions, and flash-attention varlen's ``cu_seq_lens_q/k``
and ``max_length_q/k`` from :func:`cu_seq_lens`), which transformers passes to ``flash_attn_varlen_func``: causal
attention inside each segment, and a segment is one sequence (or one row's padding tail).

Invariants (each tested in ``tests/unit/test_packing.py``): every real token appears exactly once; unpacking a
packed per-token tensor gives the padded layout back (zeros on padding); the packed forward of a causal LM equals
the padded forward per token up to reduction order. First-fit-decreasing rather than in-order: which row a sequence
lands in changes nothing in the math (the rows are unpacked before any loss), and FFD fills rows best; ties keep
the batch order, so the plan is deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "PackedBatch",
    "CAPACITY_STEPS",
    "block_causal_mask",
    "cheapest_capacity",
    "cu_seq_lens",
    "pack_lists",
    "pack_padded",
    "pad_fraction",
    "packed_slots",
    "plan_rows",
    "rows_work",
    "sequence_lengths",
    "shifted_labels",
    "token_budget_chunks",
    "unpack_next_token",
    "unpack_tokens",
    "varlen_kwargs",
    "wanted_slots",
]


def plan_rows(lengths: Sequence[int], capacity: int | None = None) -> list[list[int]]:
    """First-fit-decreasing: sequence indices per row, each row's total length ``<= capacity``.

    ``capacity`` defaults to the longest length (at least as many rows as a sequence of that length needs);
    a length above ``capacity`` is an error. Longer sequences are placed first; equal lengths keep batch order.
    """
    if any(n < 1 for n in lengths):
        raise ValueError(f"plan_rows: every sequence needs >= 1 token, got lengths {list(lengths)}")
    cap = max(lengths, default=1) if capacity is None else capacity
    if lengths and max(lengths) > cap:
        raise ValueError(f"plan_rows: a sequence of {max(lengths)} tokens exceeds the row capacity {cap}")
    rows: list[list[int]] = []
    fill: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        for r, used in enumerate(fill):
            if used + lengths[i] <= cap:
                rows[r].append(i)
                fill[r] += lengths[i]
                break
        else:
            rows.append([i])
            fill.append(lengths[i])
    return rows


CAPACITY_STEPS = (1.0, 1.25, 1.5, 1.75, 2.0)  # row capacities tried, in multiples of the longest sequence


def rows_work(lengths: Sequence[int], capacity: int, pair_ratio: float) -> float:
    """The modelled forward work of packing ``lengths`` into rows of ``capacity``: ``R * W * (1 + pair_ratio * W)``
    (every slot's per-token work, padding included, plus dense-mask attention over the row's width ``W``)."""
    plan = plan_rows(lengths, capacity)
    width = max((sum(lengths[i] for i in r) for r in plan), default=0)
    return len(plan) * width * (1.0 + pair_ratio * width)


def cheapest_capacity(lengths: Sequence[int], pair_ratio: float) -> int | None:
    """The row capacity, among :data:`CAPACITY_STEPS` times the longest sequence, with the least
    :func:`rows_work` (the first, so the smallest, on ties); ``None`` (plan_rows' default) for an empty batch.

    Rows as wide as the longest sequence leave much padding when lengths vary (an RL batch: prompts plus answers of
    any length up to the cap); wider rows fill better but each row's dense-mask attention grows with its width
    squared. ``pair_ratio`` weighs the two (attention work per slot and context slot over the per-slot work, from
    the model's shape: :func:`hybridzero.packed_forward.attention_pair_ratio`). At most twice the longest sequence,
    so the mask and attention memory grow by at most that factor. Pure and deterministic."""
    if not lengths:
        return None
    longest = max(lengths)
    candidates = sorted({max(longest, int(longest * k)) for k in CAPACITY_STEPS})
    costs = [rows_work(lengths, c, pair_ratio) for c in candidates]
    return candidates[costs.index(min(costs))]


def token_budget_chunks(lengths: Sequence[int], max_tokens: int, unit: str = "sequence") -> list[list[int]]:
    """Sequence indices per forward chunk under a token budget (``--max_tokens_per_batch``).

    First-fit-decreasing (:func:`plan_rows` with capacity ``max_tokens``): every index is in exactly one chunk, no
    chunk's lengths sum above ``max_tokens``, and the plan depends on ``lengths`` alone (ties keep batch order).
    Each chunk's indices are ascending. A ``unit`` (a sequence; a reward model's pair) longer than ``max_tokens`` is
    a one-line ``ValueError``.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens_per_batch must be >= 1, got {max_tokens}")
    longest = max(lengths, default=0)
    if longest > max_tokens:
        raise ValueError(
            f"max_tokens_per_batch {max_tokens} is below a {unit} of {longest} tokens: use "
            f"max_tokens_per_batch >= {longest} (or max_seq_len / answer lengths <= {max_tokens})"
        )
    return [sorted(chunk) for chunk in plan_rows(lengths, max_tokens)]


def block_causal_mask(segments: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[R, 1, W, W]`` additive mask from ``segments [R, W]`` (``-1``: padding): 0 where query ``i`` may see key
    ``j`` (same segment, ``j <= i``; a padding slot only itself), ``finfo(dtype).min`` elsewhere."""
    w = segments.shape[1]
    causal = torch.ones(w, w, dtype=torch.bool, device=segments.device).tril()
    same = segments[:, :, None] == segments[:, None, :]
    real = (segments >= 0)[:, :, None]
    eye = torch.eye(w, dtype=torch.bool, device=segments.device)
    allowed = (same & causal & real) | eye
    zero = torch.zeros((), dtype=dtype, device=segments.device)
    low = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=segments.device)
    return torch.where(allowed, zero, low)[:, None]


@dataclass(frozen=True)
class PackedBatch:
    """A packed batch of ``n`` sequences in ``R`` rows of width ``W``.

    ``input_ids``/``position_ids``/``segments`` are ``[R, W]``; ``row``, ``start``, ``length`` are ``[n]`` int64
    (sequence ``k`` occupies ``row[k], start[k] : start[k] + length[k]``). ``source`` is ``[n]``: for a batch packed
    from a padded ``[B, T]`` tensor, the column of each sequence's first real token (``-1`` for lists).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segments: torch.Tensor
    row: torch.Tensor
    start: torch.Tensor
    length: torch.Tensor
    source: torch.Tensor

    @property
    def num_sequences(self) -> int:
        """``n``: the number of sequences."""
        return int(self.length.numel())

    def attention_mask(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``[R, 1, W, W]`` block-causal additive mask (:func:`block_causal_mask`) in ``dtype``."""
        return block_causal_mask(self.segments, dtype)

    def model_kwargs(self, dtype: torch.dtype = torch.float32, varlen: bool = False) -> dict[str, Any]:
        """Forward keyword arguments of an HF causal LM / trunk for this packed batch (no KV cache): the
        ``[R, W]`` rows with the block-causal mask in ``dtype`` (``eager``/``sdpa``), or with ``varlen`` the rows
        flattened to ``[1, R * W]`` with flash-attention's varlen keyword arguments (:func:`varlen_kwargs`)."""
        if varlen:
            return {**varlen_kwargs(self), "use_cache": False}
        return {
            "input_ids": self.input_ids,
            "attention_mask": self.attention_mask(dtype),
            "position_ids": self.position_ids,
            "use_cache": False,
        }

    def last_token_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(row, column)`` ``[n]`` each: where each sequence's last token sits in the packed rows."""
        return self.row, self.start + self.length - 1

    def token_count(self) -> int:
        """Real tokens in the batch (the packed rows hold ``R * W`` slots)."""
        return int(self.length.sum())


def _build(seqs: Sequence[torch.Tensor], source: torch.Tensor, capacity: int | None, pad_id: int) -> PackedBatch:
    """Place 1-D token tensors ``seqs`` by :func:`plan_rows` and fill the packed tensors."""
    lengths = [int(s.numel()) for s in seqs]
    plan = plan_rows(lengths, capacity)
    width = max((sum(lengths[i] for i in r) for r in plan), default=1)
    device = seqs[0].device if seqs else torch.device("cpu")
    dtype = seqs[0].dtype if seqs else torch.long
    ids = torch.full((len(plan), width), pad_id, dtype=dtype, device=device)
    pos = torch.zeros(len(plan), width, dtype=torch.long, device=device)
    seg = torch.full((len(plan), width), -1, dtype=torch.long, device=device)
    row, start = [0] * len(seqs), [0] * len(seqs)
    for r, members in enumerate(plan):
        offset = 0
        for k in members:
            n = lengths[k]
            ids[r, offset : offset + n] = seqs[k]
            pos[r, offset : offset + n] = torch.arange(n, device=device)
            seg[r, offset : offset + n] = k
            row[k], start[k] = r, offset
            offset += n

    def as_long(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return PackedBatch(ids, pos, seg, as_long(row), as_long(start), as_long(lengths), source.to(device))


def pack_lists(seqs: Sequence[Sequence[int]], pad_id: int, capacity: int | None = None) -> PackedBatch:
    """Pack token lists (each non-empty) into rows of ``capacity`` tokens (default: the longest list)."""
    tensors = [torch.tensor(list(s), dtype=torch.long) for s in seqs]
    return _build(tensors, torch.full((len(seqs),), -1, dtype=torch.long), capacity, pad_id)


def _spans(attention_mask: torch.Tensor) -> tuple[list[int], list[int]]:
    """``(first, length)`` of each row's real tokens; raises unless they are one contiguous, non-empty run."""
    m = attention_mask.bool()
    lengths = m.sum(dim=1)
    cols = torch.arange(m.shape[1], device=m.device).expand_as(m)
    first = torch.where(m, cols, torch.full_like(cols, m.shape[1])).min(dim=1).values
    last = torch.where(m, cols, torch.full_like(cols, -1)).max(dim=1).values
    if bool((lengths == 0).any()) or bool((last - first + 1 != lengths).any()):
        bad = int(((lengths == 0) | (last - first + 1 != lengths)).nonzero()[0])
        raise ValueError(
            f"pack_padded: row {bad} of attention_mask has {int(lengths[bad])} real tokens that are not one "
            "contiguous non-empty run (packing needs left/right padding only)"
        )
    return first.tolist(), lengths.tolist()


def pack_padded(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_id: int = 0, capacity: int | None = None
) -> PackedBatch:
    """Pack the real tokens (``attention_mask`` 1, one contiguous run per row) of a padded ``[B, T]`` batch."""
    first, lengths = _spans(attention_mask)
    seqs = [input_ids[b, f : f + n] for b, (f, n) in enumerate(zip(first, lengths))]
    source = torch.tensor(first, dtype=torch.long)
    return _build(seqs, source, capacity, pad_id)


def _gather_index(packed: PackedBatch, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(b, col, r, j)``: flat index pairs mapping padded slot ``[b, col]`` <-> packed slot ``[r, j]``."""
    n = packed.length
    device = n.device
    seq = torch.repeat_interleave(torch.arange(packed.num_sequences, device=device), n)
    offset = torch.arange(int(n.sum()), device=device) - torch.repeat_interleave(n.cumsum(0) - n, n)
    if bool((packed.source < 0).any()):
        raise ValueError("unpack: this PackedBatch was built from lists (pack_lists); it has no padded layout")
    col = packed.source[seq] + offset
    if bool((col >= width).any()):
        raise ValueError(f"unpack: width {width} is narrower than the packed sequences' columns")
    return seq, col, packed.row[seq], packed.start[seq] + offset


def unpack_tokens(values: torch.Tensor, packed: PackedBatch, width: int) -> torch.Tensor:
    """Per-token ``values [R, W, ...]`` back at the padded layout ``[B, width, ...]`` (zeros on padding)."""
    b, col, r, j = _gather_index(packed, width)
    out = values.new_zeros((packed.num_sequences, width, *values.shape[2:]))
    out[b, col] = values[r, j]
    return out


def unpack_next_token(values: torch.Tensor, packed: PackedBatch, width: int) -> torch.Tensor:
    """Shifted-space values ``[R, W, ...]`` (slot ``j`` describes the token at ``j + 1``) back at ``[B, width - 1,
    ...]``: position ``t`` describes token ``t + 1``. A sequence's last slot (whose next packed token belongs to
    another sequence or is padding) is dropped; those positions, like padding, are 0 (no action mask selects them).
    """
    b, col, r, j = _gather_index(packed, width)
    keep = (j + 1) < (packed.start + packed.length)[b]
    out = values.new_zeros((packed.num_sequences, width - 1, *values.shape[2:]))
    out[b[keep], col[keep]] = values[r[keep], j[keep]]
    return out


def wanted_slots(packed: PackedBatch, wanted: torch.Tensor, width: int) -> torch.Tensor:
    """``[R, W]`` bool: the packed slots whose next-token value is wanted, from ``wanted [B, width - 1]`` in the
    padded batch's shifted space (position ``t`` describes token ``t + 1``, as :func:`unpack_next_token`); a
    sequence's last slot never is (its next packed token is another sequence's or padding)."""
    if tuple(wanted.shape) != (packed.num_sequences, width - 1):
        raise ValueError(f"wanted: shape {tuple(wanted.shape)}, expected {(packed.num_sequences, width - 1)}")
    b, col, r, j = _gather_index(packed, width)
    inside = (j + 1) < (packed.start + packed.length)[b]
    b, col, r, j = b[inside], col[inside], r[inside], j[inside]
    hit = wanted.to(device=b.device, dtype=torch.bool)[b, col]
    keep = torch.zeros(packed.input_ids.shape, dtype=torch.bool, device=packed.input_ids.device)
    keep[r[hit], j[hit]] = True
    return keep


def shifted_labels(packed: PackedBatch, labels: Sequence[Sequence[int]], ignore_index: int = -100) -> torch.Tensor:
    """``[R, W]`` labels for HF's shifted causal-LM loss on a packed batch: each sequence's own labels, its first
    label set to ``ignore_index`` (it would be predicted from the previous sequence's last token), padding ignored.
    The set of predicted (position, label) pairs is exactly the unpacked batch's."""
    out = torch.full_like(packed.input_ids, ignore_index)
    for k, lab in enumerate(labels):
        r, s, n = int(packed.row[k]), int(packed.start[k]), int(packed.length[k])
        if len(lab) != n:
            raise ValueError(f"shifted_labels: sequence {k} has {n} tokens but {len(lab)} labels")
        out[r, s + 1 : s + n] = torch.tensor(list(lab)[1:], dtype=out.dtype)
    return out


def cu_seq_lens(packed: PackedBatch) -> torch.Tensor:
    """``[n_segments + 1]`` int32 cumulative lengths of the flattened rows' segments (padding tails included as
    their own segments): flash-attention varlen's ``cu_seqlens`` for ``input_ids.flatten()`` (on the CPU)."""
    lengths: list[int] = []
    width = packed.input_ids.shape[1]
    for r in range(packed.input_ids.shape[0]):
        members = sorted((int(s), int(n)) for s, n, rr in zip(packed.start, packed.length, packed.row) if int(rr) == r)
        lengths.extend(n for _, n in members)
        tail = width - sum(n for _, n in members)
        if tail:
            lengths.append(tail)
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def varlen_kwargs(packed: PackedBatch) -> dict[str, Any]:
    """Hugging Face's padding-free format of ``packed`` for flash attention (what ``DataCollatorWithFlattening(
    return_flash_attn_kwargs=True)`` emits): ``input_ids`` and ``position_ids`` ``[1, R * W]`` (the rows
    flattened, positions restarting at every sequence), ``cu_seq_lens_q = cu_seq_lens_k`` (:func:`cu_seq_lens`,
    int32 on the rows' device) and ``max_length_q = max_length_k`` (the longest segment, a Python int); no
    ``attention_mask``. Transformers' flash path then calls ``flash_attn_varlen_func`` on the flattened tokens.

    Invariant: each segment is exactly one sequence or one row's padding tail, so causal attention inside each
    segment gives every real token the same keys as the block-causal mask. Per-slot outputs ``[1, R * W, ...]``
    reshape to the rows ``[R, W, ...]``."""
    cu = cu_seq_lens(packed).to(packed.input_ids.device)
    longest = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    return {
        "input_ids": packed.input_ids.reshape(1, -1),
        "position_ids": packed.position_ids.reshape(1, -1),
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
    }


def sequence_lengths(attention_mask: torch.Tensor) -> list[int]:
    """The real-token count of each non-empty row of a padded batch (what packing places)."""
    return [int(n) for n in attention_mask.bool().sum(dim=1).tolist() if n > 0]


def packed_slots(attention_mask: torch.Tensor, capacity: int | None = None) -> int:
    """``R * W``: the forward slots a padded batch's real tokens take once packed (no tensor is built)."""
    lengths = sequence_lengths(attention_mask)
    plan = plan_rows(lengths, capacity)
    return len(plan) * max((sum(lengths[i] for i in r) for r in plan), default=0)


def pad_fraction(real_tokens: float, slots: float) -> float:
    """Share of forward slots that are padding: ``1 - real / slots`` (0 for an empty batch)."""
    return 1.0 - real_tokens / slots if slots else 0.0

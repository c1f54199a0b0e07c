"""Value-head outputs (the reward model's scores, the critic's per-token values) under Ulysses sequence parallelism.

As :mod:`.sp_logprobs`: every rank of an SP group holds the same padded rows; they are packed
(:func:`~hybridzero.packing.pack_padded`, so left padding never meets the causal Ulysses mask), each rank forwards
its slice of the packed rows through the value model (trunk + value head) with the whole rows' block-causal mask
(:meth:`~hybridzero.runtime.sequence_parallel.SequenceParallel.shard_packed`), and the per-slot values are put back
into whole rows by :meth:`~hybridzero.runtime.sequence_parallel.SequenceParallel.whole_rows` (each rank writes its
slice, zeros elsewhere, summed over the group): every slot is exactly one rank's value, the same on every rank.

Gradient (the invariant the reward-model and critic losses rely on): when every rank of the group computes the same
loss ``L`` from these values, rank ``r``'s parameter gradient is ``s`` times its slice's part of ``dL`` (the sum's
backward all-reduces), and the engine's division by the world ``W = dp s`` leaves the mean over the data-parallel
ranks of each data rank's ``dL``: a loss that is a mean over its data rank's rows (the pairwise loss) needs no
further scaling to train as the ``s = 1`` run on the same global batch.
"""

from __future__ import annotations

import torch

from hybridzero.packed_forward import mask_dtype
from hybridzero.packing import PackedBatch, pack_padded, unpack_tokens
from hybridzero.runtime.engine import Engine

__all__ = ["sp_last_values", "sp_token_values"]


def _packed_values(
    engine: Engine, sequences: torch.Tensor, attention_mask: torch.Tensor, capacity: int | None
) -> tuple[torch.Tensor, PackedBatch]:
    """``([R, W] fp32 values of the whole packed rows, the packed batch)``: this rank's slice forwarded, the group's
    slices summed back (module docstring). Padding slots hold finite values no caller reads."""
    sp = engine.sequence_parallel
    if sp is None:
        raise ValueError("split value forwards need an engine with sequence_parallel_size > 1")
    packed = pack_padded(sequences.to(engine.device), attention_mask.to(engine.device), capacity=capacity)
    part = sp.shard_packed(packed, None, 0, mask_dtype(engine))
    part.pop("shift_labels")  # a value head predicts no token
    local = engine(**part).float()  # [R, w]: this rank's slots of every packed row
    return sp.whole_rows(local, packed.input_ids.shape[1]), packed


def sp_token_values(
    engine: Engine, sequences: torch.Tensor, attention_mask: torch.Tensor, capacity: int | None = None
) -> torch.Tensor:
    """``[B, T]`` fp32 values at every real token of the padded rows ``sequences`` (0 on padding), the same on every
    rank of the SP group (which must all pass the same rows). Differentiable (module docstring)."""
    whole, packed = _packed_values(engine, sequences, attention_mask, capacity)
    return unpack_tokens(whole, packed, sequences.shape[1])


def sp_last_values(
    engine: Engine, sequences: torch.Tensor, attention_mask: torch.Tensor, capacity: int | None = None
) -> torch.Tensor:
    """``[B]`` fp32 values at each row's last real token (a reward model's scores), the same on every rank of the
    SP group (which must all pass the same rows). Differentiable (module docstring)."""
    whole, packed = _packed_values(engine, sequences, attention_mask, capacity)
    row, col = packed.last_token_slots()
    return whole[row, col]

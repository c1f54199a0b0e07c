"""Next-token log-probabilities of rollout rows under Ulysses sequence parallelism (``sequence_parallel_size`` s).

Every rank of an SP group holds the same rollout rows (left-padded prompt, right-padded answer). The rows are packed
(:func:`~hybridzero.packing.pack_padded`, rows as wide as the longest sequence: left padding cannot go through the
causal Ulysses mask, a packed row has none) and each rank forwards its slice of the packed rows
(:meth:`~hybridzero.runtime.sequence_parallel.SequenceParallel.shard_packed`, the whole rows' block-causal mask), so
the per-token forward and backward work is split ``s`` ways. Each rank then has the log-probabilities of the slots
of its slice; they are placed at their columns of the whole packed rows (zeros elsewhere) and summed over the SP
group (:meth:`~hybridzero.runtime.sequence_parallel.SequenceParallel.whole_rows`): every rank gets the whole rows'
``[B, T-1]`` log-probabilities, exactly (each slot is one rank's value plus exact zeros), the same on every rank.

Gradient (invariant the GRPO update relies on): the sum's backward all-reduces the gradient, so when every rank of
the group computes the same loss ``L`` from these log-probabilities, rank ``r``'s slice receives ``s dL/dslice_r``
and its parameter gradient is ``s`` times its slice's part of ``dL``. The engine's division by the world size
``W = dp s`` then gives the gradient of ``L`` averaged over the data-parallel ranks only: a loss scaled for ``dp``
data ranks (``loss x dp``) trains exactly as the ``s = 1`` run on the same global batch.
"""

from __future__ import annotations

import torch

from hybridzero.packed_forward import mask_dtype
from hybridzero.packing import pack_padded, unpack_next_token
from hybridzero.runtime.engine import Engine
from hybridzero.runtime.sequence_parallel import IGNORE_INDEX

__all__ = ["sp_logprobs"]


def sp_logprobs(
    engine: Engine, sequences: torch.Tensor, attention_mask: torch.Tensor, capacity: int | None = None
) -> torch.Tensor:
    """``[B, T-1]`` fp32 log-probabilities of each next token of ``sequences`` under ``engine`` (which runs
    sequence parallelism), 0 where the next token is padding; the same tensor on every rank of the SP group, which
    must all pass the same rows. Differentiable (module docstring: gradient ``s`` times the slice's part).
    ``capacity`` (a token budget's chunk): packed rows of that many slots, each rank forwarding ``capacity / s``."""
    sp = engine.sequence_parallel
    if sp is None:
        raise ValueError("sp_logprobs needs an engine with sequence_parallel_size > 1")
    packed = pack_padded(sequences.to(engine.device), attention_mask.to(engine.device), capacity=capacity)
    part = sp.shard_packed(packed, None, 0, mask_dtype(engine))
    targets = part.pop("shift_labels")
    logits = engine(**part, use_cache=False).logits.float()  # [R, w, V]: this rank's slots of every packed row
    valid = targets != IGNORE_INDEX
    picked = logits.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    local = torch.where(valid, picked, torch.zeros_like(picked))
    whole = sp.whole_rows(local, packed.input_ids.shape[1])  # [R, W]: each slot one rank's value plus zeros
    return unpack_next_token(whole, packed, sequences.shape[1])

"""Packed forwards for training loops: the padded batch in, the padded layout's per-sample tensors out.

Each helper packs a batch (:mod:`hybridzero.packing`), runs ``model`` once on the packed rows (an
:class:`~hybridzero.runtime.engine.Engine` or any HF causal LM / value model module), and unpacks, so the caller's
math sees exactly the tensors an unpadded forward would give (same shapes, zeros on padding). ``model`` must use an
attention implementation that reads a 4D additive mask as given (Hugging Face ``eager`` and ``sdpa`` do; see
:func:`check_packable`). The mask is built in ``dtype`` (the compute dtype: ``sdpa`` wants the query's dtype).

Invariant: for every real token, the packed forward computes the same function of the same inputs as the padded
forward (same tokens before it in its own sequence, same positions); only the summation order of reductions over
padded/masked slots can differ.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hybridzero.packing import (
    PackedBatch,
    pack_lists,
    pack_padded,
    shifted_labels,
    unpack_next_token,
    unpack_tokens,
)

__all__ = [
    "PACKABLE_ATTENTION",
    "check_packable",
    "mask_dtype",
    "packed_lm_loss",
    "packed_lm_sums",
    "packed_logprobs",
    "packed_values",
    "packed_last_values",
]

PACKABLE_ATTENTION = ("eager", "sdpa")
Model = Callable[..., Any]


def mask_dtype(model: Model) -> torch.dtype:
    """The dtype the packed mask is built in: an engine's ``compute_dtype``, else float32."""
    dtype = getattr(model, "compute_dtype", torch.float32)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def check_packable(config: Any) -> None:
    """Raise ``ValueError`` unless ``config``'s attention implementation takes a 4D block-causal mask as given."""
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in PACKABLE_ATTENTION:
        raise ValueError(
            f"packing_samples needs attention implementation {' or '.join(PACKABLE_ATTENTION)} (a 4D mask as given), "
            f"got {impl!r}; load the model with attn_implementation='sdpa' or turn packing off"
        )


def _next_token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[R, W]`` fp32: slot ``j`` = log p(ids[j + 1] | ...); the last column 0 (no next token in the row)."""
    wide = logits[:, :-1].float()
    picked = wide.gather(-1, ids[:, 1:, None]).squeeze(-1) - torch.logsumexp(wide, dim=-1)
    return torch.cat([picked, picked.new_zeros(picked.shape[0], 1)], dim=1)


def packed_logprobs(
    model: Model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    dtype: torch.dtype | None = None,
    capacity: int | None = None,
) -> torch.Tensor:
    """``[B, T-1]`` fp32 next-token log-probs of a padded batch (each row's real tokens one contiguous run),
    computed on packed rows of ``capacity`` tokens (default: the longest row); 0 where token ``t + 1`` is not a
    real token of the same row."""
    packed = pack_padded(input_ids, attention_mask, capacity=capacity)
    logits = model(**packed.model_kwargs(dtype or mask_dtype(model))).logits
    return unpack_next_token(_next_token_logprobs(logits, packed.input_ids), packed, input_ids.shape[1])


def _values(model: Model, packed: PackedBatch, dtype: torch.dtype) -> torch.Tensor:
    """``[R, W]`` values of a value-head model (``forward(input_ids, attention_mask, position_ids)``)."""
    return model(
        input_ids=packed.input_ids, attention_mask=packed.attention_mask(dtype), position_ids=packed.position_ids
    )


def packed_values(
    model: Model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    dtype: torch.dtype | None = None,
    capacity: int | None = None,
) -> torch.Tensor:
    """``[B, T]`` values of a value-head model at every real token, from packed rows (0 on padding)."""
    packed = pack_padded(input_ids, attention_mask, capacity=capacity)
    return unpack_tokens(_values(model, packed, dtype or mask_dtype(model)), packed, input_ids.shape[1])


def packed_last_values(
    model: Model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    dtype: torch.dtype | None = None,
    capacity: int | None = None,
) -> torch.Tensor:
    """``[B]`` values at each row's last real token (a reward model's scores), from packed rows."""
    packed = pack_padded(input_ids, attention_mask, capacity=capacity)
    row, col = packed.last_token_slots()
    return _values(model, packed, dtype or mask_dtype(model))[row, col]


def packed_lm_loss(
    model: Model,
    examples: Sequence[tuple[Sequence[int], Sequence[int]]],
    pad_id: int,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    capacity: int | None = None,
) -> tuple[torch.Tensor, int, int]:
    """``(loss, real_tokens, slots)``: HF's causal-LM loss (mean over non-ignored labels, as unpacked) of
    ``(input_ids, labels)`` examples on packed rows of ``capacity`` tokens (default: the longest example); ``slots``
    is ``R * W`` (the padding share is ``1 - real_tokens / slots``).

    An engine with sequence parallelism (``model.sequence_parallel`` set; every rank of an SP group passes the same
    examples) forwards this rank's slice of the rows with the whole rows' block-causal mask and returns the same
    loss on every rank of the group (:meth:`~hybridzero.runtime.sequence_parallel.SequenceParallel.loss`)."""
    loss_sum, count, packed = packed_lm_sums(model, examples, pad_id, dtype, device, capacity)
    return loss_sum / count.clamp(min=1.0), packed.token_count(), int(packed.input_ids.numel())


def packed_lm_sums(
    model: Model,
    examples: Sequence[tuple[Sequence[int], Sequence[int]]],
    pad_id: int,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    capacity: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, PackedBatch]:
    """``(summed cross-entropy, predicted-token count, packed batch)`` of :func:`packed_lm_loss`'s forward (the
    sum and count over the whole rows, on every rank of an SP group)."""
    packed = pack_lists([e[0] for e in examples], pad_id, capacity)
    labels = shifted_labels(packed, [e[1] for e in examples])
    where = device if device is not None else getattr(model, "device", "cpu")
    mdtype = dtype or mask_dtype(model)
    sp = getattr(model, "sequence_parallel", None)
    if sp is not None:
        batch = {k: v.to(where) for k, v in sp.shard_packed(packed, labels, pad_id, mdtype).items()}
        targets = batch.pop("shift_labels")
        logits = model(**batch, use_cache=False).logits
        total, count = sp.token_sums(logits, targets)
        return total, count, packed
    moved = {k: v.to(where) if isinstance(v, torch.Tensor) else v for k, v in packed.model_kwargs(mdtype).items()}
    logits = model(**moved).logits
    targets = labels[:, 1:].to(where)
    total = torch.nn.functional.cross_entropy(
        logits[:, :-1].float().flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum"
    )
    return total, (targets != -100).sum().to(total.dtype), packed

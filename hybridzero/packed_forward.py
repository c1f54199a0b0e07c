"""Packed forwards for training loops: the padded batch in, the padded layout's per-sample tensors out.

Each helper packs a batch (:mod:`hybridzero.packing`), runs ``model`` once on the packed rows (an
:class:`~hybridzero.runtime.engine.Engine` or any HF causal LM / value model module), and unpacks, so the caller's
math sees exactly the tensors an unpadded forward would give (same shapes, zeros on padding). How the rows reach
the model depends on its attention implementation (:func:`packed_inputs`; :func:`check_packable` refuses others):

* ``eager`` / ``sdpa``: ``[R, W]`` rows and a 4D block-causal additive mask, which both use as given; the mask is
  built in ``dtype`` (the compute dtype: ``sdpa`` wants the query's dtype);
* a flash-attention implementation (:func:`is_varlen_attention`: ``flash_attention_2/3/4``, a hub flash kernel):
  no mask; the rows flattened to ``[1, R * W]`` with per-sequence positions and flash-attention varlen's
  ``cu_seq_lens_q/k`` / ``max_length_q/k`` keyword arguments (:func:`~hybridzero.packing.varlen_kwargs`), which HF
  models pass through to their attention function. Without a ``capacity`` the whole batch is one row: no padding
  slot at all (flash's cost follows the segments, not a row width).

Invariant: for every real token, the packed forward computes the same function of the same inputs as the padded
forward (same tokens before it in its own sequence, same positions); only the summation order of reductions over
padded/masked slots can differ.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hybridzero.head_select import next_token_logprobs_at
from hybridzero.packing import (
    PackedBatch,
    cheapest_capacity,
    pack_lists,
    pack_padded,
    sequence_lengths,
    shifted_labels,
    unpack_next_token,
    unpack_tokens,
    wanted_slots,
)

__all__ = [
    "PACKABLE_ATTENTION",
    "attention_implementation",
    "check_packable",
    "is_varlen_attention",
    "mask_dtype",
    "packed_lm_loss",
    "packed_lm_sums",
    "packed_logprobs",
    "packed_inputs",
    "packed_values",
    "packed_last_values",
    "row_capacity",
    "attention_pair_ratio",
]

PACKABLE_ATTENTION = ("eager", "sdpa")  # take the 4D block-causal mask as given
Model = Callable[..., Any]


def mask_dtype(model: Model) -> torch.dtype:
    """The dtype the packed mask is built in: an engine's ``compute_dtype``, else float32."""
    dtype = getattr(model, "compute_dtype", torch.float32)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def is_varlen_attention(impl: str | None) -> bool:
    """Whether transformers runs attention implementation ``impl`` as flash attention (so packed rows go in as
    flash-attention varlen keyword arguments, not a mask). Transformers' own rule (``is_flash_attention_requested``
    in ``transformers.utils.generic``; its mask interface and the flash kwargs follow it): ``"flash"`` in the name.
    Pure; ``tests/unit/test_packing_varlen.py`` pins the agreement with transformers."""
    return impl is not None and "flash" in impl


def attention_implementation(model: Model) -> str:
    """``model``'s attention implementation (an engine's: its module's): the HF config's ``_attn_implementation``,
    ``"eager"`` when unset."""
    config = getattr(getattr(model, "module", model), "config", None)
    return getattr(config, "_attn_implementation", None) or "eager"


def check_packable(config: Any) -> None:
    """Raise ``ValueError`` unless ``config``'s attention implementation can run packed rows: it takes a 4D
    block-causal mask as given (:data:`PACKABLE_ATTENTION`) or is a flash one (:func:`is_varlen_attention`)."""
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in PACKABLE_ATTENTION and not is_varlen_attention(impl):
        raise ValueError(
            f"packing_samples needs attention implementation {' or '.join(PACKABLE_ATTENTION)} (a 4D mask as given) "
            f"or a flash-attention one (flash_attention_2/3/4: varlen), got {impl!r}; load the model with "
            "attn_implementation='sdpa' or turn packing off"
        )


def packed_inputs(model: Model, packed: PackedBatch, dtype: torch.dtype) -> dict[str, Any]:
    """The forward keyword arguments of ``packed`` for ``model``'s attention (module docstring): flattened rows
    and flash varlen kwargs, or ``[R, W]`` rows and the block-causal mask in ``dtype``; ``use_cache`` False."""
    return packed.model_kwargs(dtype, varlen=is_varlen_attention(attention_implementation(model)))


def _rows(per_slot: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
    """A per-slot output (``[R, W, ...]``, or ``[1, R * W, ...]`` from flattened rows) as ``[R, W, ...]``."""
    return per_slot.reshape(*packed.input_ids.shape, *per_slot.shape[2:])


def attention_pair_ratio(config: Any) -> float | None:
    """Dense-mask attention work per slot and context slot over the per-slot work of the rest of a decoder forward,
    from an HF config's shape (``hidden_size``/``n_embd``, layers, heads, kv heads, ``intermediate_size``/``n_inner``;
    a gated MLP counted as three matrices): ``4 d L / (2 L (2 d^2 + 2 d d_kv + m d f))``. A model for
    :func:`~hybridzero.packing.cheapest_capacity`, not a measurement; ``None`` when the shape is unknown."""

    def get(*names: str) -> int:
        for name in names:
            value = getattr(config, name, None)
            if isinstance(value, int) and value > 0:
                return value
        return 0

    d, layers = get("hidden_size", "n_embd", "d_model"), get("num_hidden_layers", "n_layer", "num_layers")
    heads = get("num_attention_heads", "n_head")
    if not (d and layers and heads):
        return None
    kv = get("num_key_value_heads") or heads
    ff = get("intermediate_size", "n_inner", "ffn_dim") or 4 * d
    mlp = 3 if getattr(config, "hidden_act", None) in ("silu", "swiglu") else 2
    per_slot = 2 * layers * (2 * d * d + 2 * d * (d * kv // heads) + mlp * d * ff)
    return 4.0 * d * layers / per_slot


def row_capacity(model: Model, lengths: Sequence[int], capacity: int | None = None) -> int | None:
    """The packed-row capacity a forward of ``model`` uses for sequences of ``lengths``: the caller's ``capacity``;
    else under flash attention all the tokens in one row (no padding slot: flash's cost follows the segments, not
    a row width); else the cheapest by :func:`~hybridzero.packing.cheapest_capacity` for the model's shape (the
    longest sequence, :func:`~hybridzero.packing.plan_rows`' default, when the shape is unknown)."""
    if capacity is not None:
        return capacity
    if is_varlen_attention(attention_implementation(model)):
        return max(sum(lengths), 1)
    ratio = attention_pair_ratio(getattr(getattr(model, "module", model), "config", None))
    return None if ratio is None else cheapest_capacity(lengths, ratio)


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
    wanted: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[B, T-1]`` fp32 next-token log-probs of a padded batch (each row's real tokens one contiguous run),
    computed on packed rows of ``capacity`` tokens (default: :func:`row_capacity`'s choice; under flash attention
    one row of all the tokens); 0 where token ``t + 1`` is not a real token of the same row. ``wanted [B, T-1]``:
    only those positions are computed (the output head runs on their slots only, :mod:`hybridzero.head_select`); 0
    elsewhere."""
    packed = pack_padded(
        input_ids, attention_mask, capacity=row_capacity(model, sequence_lengths(attention_mask), capacity)
    )
    inputs = packed_inputs(model, packed, dtype or mask_dtype(model))
    if wanted is not None:
        keep = wanted_slots(packed, wanted, input_ids.shape[1])
        if is_varlen_attention(attention_implementation(model)):  # the rows go in flattened to one
            keep = keep.reshape(1, -1)
        per_slot = next_token_logprobs_at(model, inputs, packed.input_ids.reshape(keep.shape), keep)
        return unpack_next_token(per_slot.reshape(packed.input_ids.shape), packed, input_ids.shape[1])
    logits = _rows(model(**inputs).logits, packed)
    return unpack_next_token(_next_token_logprobs(logits, packed.input_ids), packed, input_ids.shape[1])


def _values(model: Model, packed: PackedBatch, dtype: torch.dtype) -> torch.Tensor:
    """``[R, W]`` values of a value-head model (``forward(input_ids, attention_mask, position_ids, **varlen)``)."""
    inputs = packed_inputs(model, packed, dtype)
    del inputs["use_cache"]  # a value model runs its trunk without a cache anyway
    return _rows(model(**inputs), packed)


def packed_values(
    model: Model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    dtype: torch.dtype | None = None,
    capacity: int | None = None,
) -> torch.Tensor:
    """``[B, T]`` values of a value-head model at every real token, from packed rows (0 on padding)."""
    packed = pack_padded(
        input_ids, attention_mask, capacity=row_capacity(model, sequence_lengths(attention_mask), capacity)
    )
    return unpack_tokens(_values(model, packed, dtype or mask_dtype(model)), packed, input_ids.shape[1])


def packed_last_values(
    model: Model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    dtype: torch.dtype | None = None,
    capacity: int | None = None,
) -> torch.Tensor:
    """``[B]`` values at each row's last real token (a reward model's scores), from packed rows."""
    packed = pack_padded(
        input_ids, attention_mask, capacity=row_capacity(model, sequence_lengths(attention_mask), capacity)
    )
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
    ``(input_ids, labels)`` examples on packed rows of ``capacity`` tokens (default: :func:`row_capacity`'s choice;
    under flash attention one row of them all); ``slots`` is ``R * W`` (the padding share is ``1 - real_tokens /
    slots``).

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
    packed = pack_lists([e[0] for e in examples], pad_id, row_capacity(model, [len(e[0]) for e in examples], capacity))
    labels = shifted_labels(packed, [e[1] for e in examples])
    where = device if device is not None else getattr(model, "device", "cpu")
    mdtype = dtype or mask_dtype(model)
    sp = getattr(model, "sequence_parallel", None)  # Ulysses over an sdpa/eager core: the whole rows' mask
    if sp is not None:
        batch = {k: v.to(where) for k, v in sp.shard_packed(packed, labels, pad_id, mdtype).items()}
        targets = batch.pop("shift_labels")
        logits = model(**batch, use_cache=False).logits
        total, count = sp.token_sums(logits, targets)
        return total, count, packed
    inputs = packed_inputs(model, packed, mdtype)
    logits = _rows(
        model(**{k: v.to(where) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}).logits, packed
    )
    targets = labels[:, 1:].to(where)
    total = torch.nn.functional.cross_entropy(
        logits[:, :-1].float().flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum"
    )
    return total, (targets != -100).sum().to(total.dtype), packed

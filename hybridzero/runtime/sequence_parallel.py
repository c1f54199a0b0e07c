"""Ulysses sequence parallelism inside the ZeRO engine (``sequence_parallel_size`` = s, DeepSpeed's key).

Layout: groups of ``s`` consecutive ranks form a sequence-parallel (SP) group; the ``W / s`` ranks with the same SP
rank form a data-parallel (DP) group for the batch. All ranks of one SP group read the same samples; each holds the
contiguous slice ``[r L/s, (r+1) L/s)`` of every sequence (:meth:`SequenceParallel.shard_batch`). Parameters stay
ZeRO-sharded over the whole world (the engine does not change).

Invariants:
* attention sees the whole sequence: :class:`~hybridzero.runtime.ulysses.UlyssesAttention`, registered through
  transformers' ``AttentionInterface`` under a name of this object's own and selected with the model's
  ``attn_implementation`` (two all-to-alls per layer and forward, two per layer in backward);
* position ids are the global positions of the local slice; labels are shifted on the whole sequence before the
  split (the last position of slice ``r`` predicts the first token of slice ``r + 1``);
* :meth:`SequenceParallel.loss` returns on every rank of the group the per-token mean over the whole sequence (one
  all-reduce of (sum, count)); its backward all-reduces the gradient of the sum, so rank ``r``'s parameter gradient is
  ``s`` times its slice's part. The engine's one division by the world size ``W = dp * s`` then yields the sum over
  the SP group and the mean over the DP group: the gradient of the ``s = 1`` run on the same global batch, with the
  engine's divide-exactly-once unchanged.
"""

from __future__ import annotations

import contextlib
import importlib
import uuid
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybridzero.comm.collectives import Comm
from hybridzero.packing import PackedBatch
from hybridzero.runtime.sp_packing import shard_packed
from hybridzero.runtime.ulysses import UlyssesAttention

IGNORE_INDEX = -100
SPLITTABLE = ("sdpa", "eager")  # the cores whose full-sequence call this module drives (causal mask built here)


def sp_groups(world: int, size: int) -> list[list[int]]:
    """SP groups: ``size`` consecutive ranks each (pure)."""
    return [list(range(start, start + size)) for start in range(0, world, size)]


def check_model(config: Any, size: int) -> None:
    """Raise a one-line ValueError unless a model with HF ``config`` can run Ulysses over ``size`` ranks (pure)."""
    if size == 1:
        return
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    if heads <= 0 or heads % size:
        raise ValueError(
            f"sequence_parallel_size = {size} must divide num_attention_heads = {heads} (each rank attends with "
            f"num_attention_heads / {size} heads); valid sizes: {_divisors(heads)}"
        )
    if kv <= 0 or heads % kv:
        raise ValueError(f"num_key_value_heads = {kv} must divide num_attention_heads = {heads} for Ulysses")
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl.startswith("hybridzero_ulysses"):
        raise ValueError("the model already runs Ulysses attention (one engine per model)")
    if impl not in SPLITTABLE:
        raise ValueError(
            f"attn_implementation = {impl!r} cannot be split by sequence_parallel_size = {size}: use one of "
            f"{', '.join(map(repr, SPLITTABLE))} (from_pretrained(..., attn_implementation='sdpa'))"
        )
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True):
        raise ValueError(
            f"sliding_window = {window} is not supported with sequence_parallel_size = {size}: the Ulysses mask is "
            "causal over the full sequence; use a model without a sliding window or sequence_parallel_size = 1"
        )


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n and n % d == 0) or "none"


def shift_labels(labels: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Next-token targets of the whole sequence: position ``t`` predicts ``labels[t + 1]``; the last position and
    positions whose target is masked out get ``IGNORE_INDEX`` (pure)."""
    out = torch.full_like(labels, IGNORE_INDEX)
    out[:, :-1] = labels[:, 1:]
    if attention_mask is not None:
        out[:, :-1] = out[:, :-1].masked_fill(attention_mask[:, 1:] == 0, IGNORE_INDEX)
    return out


def pad_to_multiple(t: torch.Tensor, size: int, value: int) -> torch.Tensor:
    """``t [B, L]`` right-padded with ``value`` to a multiple of ``size`` positions (pure)."""
    extra = -t.shape[1] % size
    return F.pad(t, (0, extra), value=value) if extra else t


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) over the SP group; backward all-reduces the gradient (the adjoint of a sum over ranks)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        out = x.clone()
        comm.all_reduce(out, phase="forward")
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.clone()
        ctx.comm.all_reduce(out, phase="backward")
        return out, None


class SequenceParallel:
    """The SP layout of one engine (every rank constructs it together: it forms the SP process groups).

    ``comm`` is the SP group; ``dp_rank`` / ``dp_size`` index the batch (ranks of one SP group share a DP rank)."""

    def __init__(self, world: Comm, size: int) -> None:
        self.size = size
        self.comm = world.split(sp_groups(world.world_size, size), name="sp")
        self.rank = self.comm.rank
        self.dp_rank = world.rank // size
        self.dp_size = world.world_size // size
        self.name = f"hybridzero_ulysses_{uuid.uuid4().hex[:12]}"  # this object's own attention-interface entry
        self._restore: list[tuple[Any, str]] = []

    # --- the model --------------------------------------------------------------------------------------------
    def attach(self, model: nn.Module, local_in_eval: bool = False) -> None:
        """Register this group's Ulysses attention and select it on ``model`` (and its sub-configs); the model's
        previous implementation is the core. :meth:`detach` restores it. ``local_in_eval``: a module in eval mode
        attends over its whole unsplit input (DeepSpeed's ``disable_in_eval``)."""
        # transformers is imported here, not at module level: `import hybridzero.as_deepspeed` must install the
        # deepspeed alias before transformers/accelerate are first imported (they decide then whether deepspeed is
        # available), and the package imports this module.
        from transformers import AttentionInterface  # noqa: PLC0415 - after the alias (above)
        from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: PLC0415 - after the alias (above)
        from transformers.masking_utils import AttentionMaskInterface  # noqa: PLC0415 - after the alias (above)

        config = getattr(model, "config", None)
        check_model(config, self.size)
        impl = getattr(config, "_attn_implementation", None) or "eager"
        core = sdpa_attention_forward if impl == "sdpa" else _eager_core
        AttentionInterface.register(self.name, UlyssesAttention(self.comm, core, impl == "eager", local_in_eval))
        AttentionMaskInterface.register(self.name, _no_local_mask)  # the local slice's mask would be wrong: none
        for sub in model.modules():
            cfg = getattr(sub, "config", None)
            if cfg is not None and getattr(cfg, "_attn_implementation", None) == impl:
                self._restore.append((cfg, impl))
                cfg._attn_implementation = self.name

    @property
    def attached(self) -> bool:
        """Whether a model runs this group's attention (between :meth:`attach` and :meth:`detach`)."""
        return bool(self._restore)

    @contextlib.contextmanager
    def local_attention(self) -> Iterator[None]:
        """Inside: the model runs its own attention on whole, unsplit sequences (generation: a decode step's one
        token cannot be split over ranks, so each rank generates for its own prompts on the gathered weights, with
        no exchange); on exit it runs this group's Ulysses attention again (training forwards keep SP). Nothing is
        re-registered; a no-op while detached."""
        held = list(self._restore)
        for cfg, impl in held:
            cfg._attn_implementation = impl
        try:
            yield
        finally:
            for cfg, _ in held:
                cfg._attn_implementation = self.name

    def detach(self) -> None:
        """Give the model its own attention implementation back (idempotent)."""
        while self._restore:
            cfg, impl = self._restore.pop()
            cfg._attn_implementation = impl

    # --- the batch ---------------------------------------------------------------------------------------------
    def shard_batch(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        pad_token_id: int = 0,
    ) -> dict[str, torch.Tensor]:
        """This rank's slice of a whole batch ``[B, L]`` (every rank of the SP group passes the same batch):
        ``input_ids``, ``position_ids`` (global) and ``shift_labels`` (next-token targets, ``-100`` ignored).

        ``L`` is right-padded to a multiple of ``s`` (pad tokens with ignored targets: under the causal mask they
        change nothing before them). ``attention_mask`` may only mark right padding (its targets are ignored)."""
        s = self.size
        length = input_ids.shape[1]
        if length < s:
            raise ValueError(
                f"sequence length {length} is shorter than sequence_parallel_size = {s}: every rank needs at least "
                f"one position; use sequences of >= {s} tokens or a smaller sequence_parallel_size"
            )
        if attention_mask is not None and bool((attention_mask[:, 1:] > attention_mask[:, :-1]).any()):
            raise ValueError(
                "attention_mask with left padding (or holes) is not supported with sequence parallelism: the Ulysses "
                "mask is causal over the whole row; pad on the right (its targets are ignored)"
            )
        targets = shift_labels(input_ids if labels is None else labels, attention_mask)
        ids = pad_to_multiple(input_ids, s, pad_token_id)
        targets = pad_to_multiple(targets, s, IGNORE_INDEX)
        local = ids.shape[1] // s
        lo, hi = self.rank * local, (self.rank + 1) * local
        positions = torch.arange(lo, hi, device=ids.device).expand(ids.shape[0], -1)
        return {"input_ids": ids[:, lo:hi], "position_ids": positions, "shift_labels": targets[:, lo:hi]}

    def shard_packed(
        self,
        packed: PackedBatch,
        labels: torch.Tensor | None = None,
        pad_token_id: int = 0,
        dtype: torch.dtype = torch.float32,
    ) -> dict[str, torch.Tensor]:
        """This rank's slice of packed rows (every rank of the SP group passes the same ``packed``): ``input_ids``,
        per-sequence ``position_ids``, ``shift_labels`` and the whole row's block-causal ``attention_mask``
        (:func:`hybridzero.runtime.sp_packing.shard_packed`). ``labels``: HF's per-slot labels (None: the tokens)."""
        return shard_packed(packed, self.rank, self.size, labels, pad_token_id, dtype)

    # --- the loss ----------------------------------------------------------------------------------------------
    def sum_over_group(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the SP group, on every rank; differentiable: the backward all-reduces the gradient
        (so a loss every rank computes alike from the sum gives each rank ``s`` times its own part's gradient)."""
        out: torch.Tensor = _SumOverGroup.apply(t, self.comm)
        return out

    def whole_rows(self, local: torch.Tensor, width: int) -> torch.Tensor:
        """``[R, width]``: every rank's ``[R, w]`` per-slot values of its slice (rank ``r``: columns
        ``[r w, (r+1) w)`` of the padded rows) put at their columns, zeros elsewhere, and summed over the SP group;
        ``width`` cuts the right padding. Exact (each column is one rank's value plus zeros) and the same on every
        rank; differentiable as :meth:`sum_over_group` (rank ``r``'s slice gets ``s`` times its columns' gradient)."""
        w = local.shape[1]
        placed = F.pad(local, (self.rank * w, (self.size - 1 - self.rank) * w))  # [R, w s]
        return self.sum_over_group(placed)[:, :width]

    def loss(self, logits: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
        """Per-token mean cross-entropy over the whole sequence, on every rank of the SP group (equal to the
        ``s = 1`` loss up to summation order): one all-reduce of (sum, count) in forward and one in backward."""
        total, count = self.token_sums(logits, shift_labels)
        return total / count.clamp(min=1.0)

    def token_sums(self, logits: torch.Tensor, shift_labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(summed cross-entropy, target count)`` over the whole sequences, on every rank of the SP group: one
        all-reduce in forward and one in backward (the gradient of the sum, as :meth:`loss`)."""
        total = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]),
            shift_labels.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        count = (shift_labels != IGNORE_INDEX).sum().to(total.dtype)
        both = _SumOverGroup.apply(torch.stack([total, count]), self.comm)
        return both[0], both[1]


def _no_local_mask(*args: Any, **kwargs: Any) -> None:
    """The model builds no mask for its local slice: Ulysses attention builds the full sequence's causal mask."""
    return None


def _eager_core(module: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """The model's own eager kernel (``eager_attention_forward`` of its modeling module)."""
    owner = module._module if hasattr(module, "_module") else module
    kernel = getattr(importlib.import_module(type(owner).__module__), "eager_attention_forward", None)
    if kernel is None:
        raise ValueError(
            f"{type(owner).__name__} has no eager_attention_forward to run under sequence parallelism; load the "
            "model with attn_implementation='sdpa'"
        )
    return kernel(module, *args, **kwargs)

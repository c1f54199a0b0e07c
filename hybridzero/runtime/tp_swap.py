"""The swap that turns a ZeRO-3 model into its tensor-parallel generation form, and back.

``TensorParallelSwap(coordinator, tp_comm, family, layers_per_gather).swapped()`` -- a context manager:

* entry (engine quiescent): the ZeRO-3 groups holding anything outside the transformer layers (embeddings, final
  norm, ``lm_head``: the root group) are gathered and pinned for the whole block. Then the layers are visited
  ``layers_per_gather`` at a time (``hybrid_engine.tp_gather_partition_size``, DeepSpeed's meaning: how many layers
  are gathered at once while the tensor-parallel copies are cut): their groups are gathered, LoRA adapters merged
  into the gathered buffers (:func:`hybridzero.lora.merged_lora`), this rank's slices of every projection and copies
  of the layer's other parameters (norms, row-parallel biases) taken, and the groups released. The slices replace
  the projections (:mod:`hybridzero.runtime.tp_layers`) -- set on their parent module, or on a clone of the parent
  when its ``forward`` reads a head count -- and every other parameter-holding module of the layer is replaced by a
  clone holding copies. The coordinator's hooks are bypassed and HF's sharded-engine flag cleared.
* exit (also on an exception): every replaced module is set back (reverse order), hooks and flag return, the resident
  groups are released. The shards were never written (slices and merges are copies or transient buffers), so the
  model is bit-exactly what it was and the engine quiescent.

Invariant: while swapped, each rank holds ``1/t`` of every projection plus whole copies of the small per-layer
parameters and the resident groups; :class:`TPStats` reports those bytes (and the peak while cutting).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from hybridzero.comm.collectives import Comm
from hybridzero.lora import merged_lora
from hybridzero.runtime.tp_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    column_slice,
    linear_weight,
    local_clone,
    row_slice,
)
from hybridzero.runtime.tp_plans import COLUMN, Family, Split
from hybridzero.zero.coordinator import ZeroCoordinator
from hybridzero.zero.groups import ShardedGroup


@dataclass
class TPStats:
    """Bytes this rank held for one tensor-parallel generation (compute dtype).

    ``projection_bytes``: the slices of every split projection (weights and column-parallel biases);
    ``copied_bytes``: copies of the layers' other parameters; ``resident_bytes``: ZeRO-3 groups kept gathered whole
    (the root group: embeddings, final norm, lm_head); ``peak_bytes``: the high-water mark while cutting (resident
    + slices so far + one bucket of layer groups gathered); ``full_hybrid_bytes``: what whole-model hybrid generation
    holds (every ZeRO-3 group gathered at once)."""

    tp_size: int
    layers_per_gather: int
    projection_bytes: int = 0
    copied_bytes: int = 0
    resident_bytes: int = 0
    peak_bytes: int = 0
    full_hybrid_bytes: int = 0

    @property
    def held_bytes(self) -> int:
        """Everything held while decoding."""
        return self.projection_bytes + self.copied_bytes + self.resident_bytes


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _group_bytes(groups: list[ShardedGroup]) -> int:
    return sum(g.numel * g.compute_dtype.itemsize for g in groups)


def _unique(groups: list[ShardedGroup]) -> list[ShardedGroup]:
    seen: dict[int, ShardedGroup] = {}
    for g in groups:
        seen.setdefault(id(g), g)
    return list(seen.values())


class TensorParallelSwap:
    """Owns one swap of the model's layers for tensor-parallel copies (see module docstring)."""

    def __init__(self, coordinator: ZeroCoordinator, comm: Comm, family: Family, layers_per_gather: int) -> None:
        self.coordinator = coordinator
        self.comm = comm
        self.family = family
        self.layers_per_gather = layers_per_gather
        self.module = coordinator.module
        self.layers = list(self.module.get_submodule(family.layers).children())
        self.stats = TPStats(comm.world_size, layers_per_gather)
        self._restore: list[tuple[nn.Module, str, nn.Module]] = []

    # --- which groups ---------------------------------------------------------------------------------------------
    def _plan_groups(self) -> tuple[list[ShardedGroup], list[list[ShardedGroup]]]:
        """(resident groups, each layer's other ZeRO-3 groups)."""
        owner = {id(s.param): g for g in self.coordinator.groups if not g.always_full for s in g.slots}
        in_layers = {id(p) for layer in self.layers for p in layer.parameters()}
        resident = _unique([g for g in owner.values() if any(id(s.param) not in in_layers for s in g.slots)])
        per_layer = [
            _unique([owner[id(p)] for p in layer.parameters() if id(p) in owner and owner[id(p)] not in resident])
            for layer in self.layers
        ]
        return resident, per_layer

    # --- the swap -------------------------------------------------------------------------------------------------
    @contextmanager
    def swapped(self) -> Iterator[TPStats]:
        """The model in tensor-parallel form inside the block (see module docstring)."""
        coord = self.coordinator
        coord.release_held()
        coord.assert_quiescent()
        was_training = self.module.training
        self.module.eval()
        resident, per_layer = self._plan_groups()
        zero3 = [g for g in coord.groups if not g.always_full]
        self.stats.full_hybrid_bytes = _group_bytes(zero3)
        self.stats.resident_bytes = _group_bytes(resident)
        synced_flag = getattr(self.module, "_is_fsdp_managed_module", None)
        for g in resident:
            g.pins += 1
        try:
            self._gather(resident)
            for start in range(0, len(self.layers), self.layers_per_gather):
                self._cut_bucket(range(start, min(start + self.layers_per_gather, len(self.layers))), per_layer)
            coord.bypass = True
            if synced_flag is not None:
                setattr(self.module, "_is_fsdp_managed_module", False)  # noqa: B010 - HF's flag: nothing to sync
            yield self.stats
        finally:
            for parent, name, original in reversed(self._restore):
                setattr(parent, name, original)
            self._restore.clear()
            if synced_flag is not None:
                self.module._is_fsdp_managed_module = synced_flag
            coord.bypass = False
            for g in resident:
                g.pins -= 1
                coord.release(g)
            self.module.train(was_training)

    def _gather(self, groups: list[ShardedGroup]) -> None:
        for g in groups:
            g.start_gather("generate")
        for g in groups:
            g.wait("generate")

    def _cut_bucket(self, indices: range, per_layer: list[list[ShardedGroup]]) -> None:
        """Gather the bucket's layers, cut their tensor-parallel copies, release, then swap the copies in."""
        groups = _unique([g for i in indices for g in per_layer[i]])
        gathered_ids = {id(s.param) for g in groups for s in g.slots}
        for g in groups:
            g.pins += 1
        swaps: list[tuple[nn.Module, str, nn.Module]] = []
        try:
            self._gather(groups)
            held = self.stats.projection_bytes + self.stats.copied_bytes
            self.stats.peak_bytes = max(self.stats.peak_bytes, self.stats.resident_bytes + held + _group_bytes(groups))
            with ExitStack() as stack, torch.no_grad():
                for i in indices:  # LoRA: W + s * R @ L written into the gathered buffers (dropped on release)
                    stack.enter_context(merged_lora(self.layers[i], lambda p: id(p) in gathered_ids))
                for i in indices:
                    swaps += self._layer_swaps(self.layers[i])
        finally:
            for g in groups:
                g.pins -= 1
                self.coordinator.release(g)
        for parent, name, new in swaps:
            self._restore.append((parent, name, getattr(parent, name)))
            setattr(parent, name, new)

    def _layer_swaps(self, layer: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
        """``(parent, child name, replacement)`` for one layer: split projections, clones with local sizes, copies."""
        config = getattr(self.module, "config", None)
        attrs = self.family.local_attrs(config, self.comm.world_size)
        new: dict[str, nn.Module] = {s.path: self._split(layer.get_submodule(s.path), s) for s in self.family.splits}
        for path, sub in layer.named_modules():
            if path and path not in new and any(True for _ in sub.parameters(recurse=False)):
                if not any(path.startswith(p + ".") for p in new):
                    new[path] = local_clone(sub, copy_params=True)
                    self.stats.copied_bytes += sum(_nbytes(b) for b in new[path].buffers(recurse=False))
        if any(True for _ in layer.parameters(recurse=False)):
            raise TypeError(f"tensor-parallel generation: {type(layer).__name__} holds parameters of its own")
        for parent_path, values in attrs.items():  # a parent whose forward reads a size: a clone owns the swap
            inside = {p[len(parent_path) + 1 :]: m for p, m in new.items() if p.startswith(parent_path + ".")}
            for p in [p for p in new if p.startswith(parent_path + ".")]:
                del new[p]
            new[parent_path] = local_clone(layer.get_submodule(parent_path), _direct(inside), values)
        out = []
        for path, module in new.items():
            parent_path, _, name = path.rpartition(".")
            out.append((layer.get_submodule(parent_path) if parent_path else layer, name, module))
        return out

    def _split(self, linear: nn.Module, split: Split) -> nn.Module:
        """This rank's parallel layer for one projection (copies; stats updated)."""
        weight, bias = linear_weight(linear, split.transposed)
        rank, t = self.comm.rank, self.comm.world_size
        if split.kind == COLUMN:
            w, b = column_slice(weight, bias, rank, t, split.chunks)
            self.stats.projection_bytes += _nbytes(w) + _nbytes(b)
            return ColumnParallelLinear(w, b)
        w = row_slice(weight, rank, t)
        b = None if bias is None else bias.detach().clone()
        self.stats.projection_bytes += _nbytes(w)
        self.stats.copied_bytes += _nbytes(b)
        return RowParallelLinear(w, b, self.comm)


def _direct(inside: dict[str, nn.Module]) -> dict[str, nn.Module]:
    """Children replacements of a cloned parent (only direct children can be replaced there)."""
    nested = [p for p in inside if "." in p]
    if nested:
        raise TypeError(f"tensor-parallel generation: cannot replace nested modules {nested} inside a cloned parent")
    return inside

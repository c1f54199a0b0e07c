"""Tensor fragments: one parameter's part of the flat master, gradient and optimizer-state shards.

DeepSpeed's ``deepspeed.utils.safe_get_full_*`` / ``safe_set_full_*`` / ``safe_get_local_*`` / ``safe_set_local_*``
read and write one parameter's fp32 state. :class:`TensorFragments` is what an engine registers as the owner of its
parameters (:data:`hybridzero.zero.registry.REGISTRY`): it answers ``GatheredParameters`` through the
coordinator-side :class:`ZeroParamOwner` and the fragment API through the groups' flat buffers.

Coordinates (shapes from metadata): a parameter is the range ``[offset, end)`` of its group's padded flat
buffer. This rank's master (and the optimizer state, which lives on views of the master) covers the whole buffer
when ``group.master_is_whole`` (stage 0, persistent parameters), else ``layout.shard_range(rank)``; the fp32 gradient
shard covers the whole buffer only for replicated (persistent) groups. "Local" values are this rank's part of the
parameter, flattened: with ZeRO it may be empty, and partition boundaries are the group buffer's, not the
parameter's (DeepSpeed partitions each parameter separately).

Frozen parameters read as ``None`` (value, gradient and optimizer state: DeepSpeed keeps no fp32 state for them);
``safe_set_*_fp32_param`` still writes a frozen parameter's value (DeepSpeed ignores such a write silently).

Invariants: ``full_*`` reads are collectives over the world when the state is sharded (every rank calls them, as in
DeepSpeed, and every rank gets the full value); every write to a master goes through
:meth:`ShardedGroup.write_shard`, so the compute copies and any hpZ secondary are refreshed; writes to a ZeRO-3 group
are refused while it is gathered. Gradients are the reduced, averaged fp32 gradients in the shards (valid after
``backward`` at the accumulation boundary, before ``step``; zero after ``step``), divided by the fp16 loss scale.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Protocol

import torch
from torch import nn

from hybridzero.zero.gathered import ZeroParamOwner
from hybridzero.zero.groups import ShardedGroup, Slot
from hybridzero.zero.layout import intersect
from hybridzero.zero.offload import move

_PHASE = "fragments"


class FragmentHost(Protocol):
    """What the fragment API needs of an engine: its optimizer and the current fp16 loss scale."""

    @property
    def optimizer(self) -> torch.optim.Optimizer | None: ...

    @property
    def loss_scale(self) -> float: ...

    def optimizer_state_resident(self) -> AbstractContextManager[None]:
        """Inside the block every leaf's state is in ``optimizer.state`` (NVMe offload swaps it out between steps)."""
        ...


def master_range(group: ShardedGroup) -> tuple[int, int]:
    """The flat range this rank's master (and optimizer state) covers."""
    return (0, group.layout.padded_numel) if group.master_is_whole else group.layout.shard_range(group.comm.rank)


def grad_range(group: ShardedGroup) -> tuple[int, int]:
    """The flat range this rank's fp32 gradient shard covers."""
    return (0, group.layout.padded_numel) if group.replicated else group.layout.shard_range(group.comm.rank)


def _full(group: ShardedGroup, local: torch.Tensor, whole: bool) -> torch.Tensor:
    """The group's whole flat buffer of a per-rank tensor (an all-gather unless ``whole``)."""
    if whole:
        return local
    local = move(local, group.device)  # offloaded shards live on the host; the collective runs on the device
    out = torch.empty(group.layout.padded_numel, dtype=local.dtype, device=local.device)
    group.comm.all_gather(out, local.contiguous(), phase=_PHASE)
    return out


def param_part(rng: tuple[int, int], slot: Slot) -> tuple[int, int, int, int] | None:
    """``(lo, hi)`` in local coordinates and ``(plo, phi)`` in the flattened parameter, of their overlap."""
    hit = intersect(rng, (slot.spec.offset, slot.spec.end))
    if hit is None:
        return None
    return hit[0] - rng[0], hit[1] - rng[0], hit[0] - slot.spec.offset, hit[1] - slot.spec.offset


class TensorFragments:
    """One engine's parameters: the :class:`ParamOwner` it registers, and DeepSpeed's tensor-fragment API."""

    def __init__(self, zero: ZeroParamOwner, host: FragmentHost) -> None:
        self.zero = zero
        self.host = host

    def gathered(self, params: list[nn.Parameter], modifier_rank: int | None) -> AbstractContextManager[None]:
        """``GatheredParameters`` for these parameters (see :mod:`hybridzero.zero.gathered`)."""
        return self.zero.gathered(params, modifier_rank)

    # --- optimizer state ------------------------------------------------------------------------------------------
    def _leaves(self, group: ShardedGroup) -> Iterator[tuple[int, nn.Parameter]]:
        """``(offset in this rank's master, leaf)`` of every optimizer leaf that views ``group.master``."""
        opt = self.host.optimizer
        if opt is None:
            return
        storage = group.master.untyped_storage().data_ptr()
        for pg in opt.param_groups:
            for leaf in pg["params"]:
                if leaf.untyped_storage().data_ptr() == storage:
                    yield leaf.storage_offset() - group.master.storage_offset(), leaf

    def _state_keys(self) -> set[str]:
        opt = self.host.optimizer
        if opt is None:
            return set()
        with self.host.optimizer_state_resident():
            return {
                k
                for leaf, st in opt.state.items()
                for k, v in st.items()
                if isinstance(v, torch.Tensor) and v.shape == leaf.shape
            }

    def _check_key(self, key: str, what: str) -> None:
        keys = self._state_keys()
        if key not in keys:
            raise KeyError(
                f"{what}: optimizer state has no per-element key {key!r}; valid: {sorted(keys)} (state "
                f"is created by the first optimizer step)"
            )

    def _local_state(self, group: ShardedGroup, key: str) -> torch.Tensor:
        """``key``'s state in this rank's master coordinates (zero where no leaf covers: frozen, padding)."""
        opt = self.host.optimizer
        assert opt is not None
        with self.host.optimizer_state_resident():  # NVMe offload: masters resident too, leaves viewing them
            out = torch.zeros(group.master.numel(), dtype=torch.float32, device=group.device)
            for lo, leaf in self._leaves(group):
                value = opt.state.get(leaf, {}).get(key)
                if isinstance(value, torch.Tensor) and value.shape == leaf.shape:
                    out[lo : lo + leaf.numel()] = value
        return out

    # --- full values (collectives) --------------------------------------------------------------------------------
    def full_fp32(self, param: torch.Tensor) -> torch.Tensor | None:
        """The parameter's fp32 master value, whole, on every rank (None for a frozen parameter, as DeepSpeed, which
        keeps no fp32 copy of one: its value is read through ``GatheredParameters``). Called by every rank even for a
        frozen parameter: the answer is decided on metadata, so every rank agrees without a collective."""
        group, slot = self.zero.locate(param)
        if not slot.trainable:
            return None
        with group.master_resident() as master:  # NVMe offload: read from its file
            flat = _full(group, master, group.master_is_whole)
        return flat[slot.spec.offset : slot.spec.end].view(slot.spec.shape).clone()

    def full_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """The reduced, averaged fp32 gradient, whole, on every rank (None for a frozen parameter)."""
        group, slot = self.zero.locate(param)
        if not slot.trainable:
            return None
        flat = _full(group, group.grad_shard, group.replicated)
        return flat[slot.spec.offset : slot.spec.end].view(slot.spec.shape) / self.host.loss_scale

    def full_optimizer_state(self, param: torch.Tensor, key: str) -> torch.Tensor | None:
        """Optimizer state ``key`` (e.g. ``exp_avg``), whole, on every rank (None for a frozen parameter)."""
        group, slot = self.zero.locate(param)
        if not slot.trainable:
            return None
        self._check_key(key, "safe_get_full_optimizer_state")
        flat = _full(group, self._local_state(group, key), group.master_is_whole)
        return flat[slot.spec.offset : slot.spec.end].view(slot.spec.shape).clone()

    def _check_value(self, slot: Slot, value: torch.Tensor, what: str) -> torch.Tensor:
        if tuple(value.shape) != tuple(slot.spec.shape):
            raise ValueError(
                f"{what}: value of shape {tuple(value.shape)} for parameter {slot.spec.name!r} of shape "
                f"{tuple(slot.spec.shape)}"
            )
        return value.detach().reshape(-1)

    def set_full_fp32(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Every rank passes the same whole ``value``; each writes its part of the master, then ``write_shard``."""
        group, slot = self.zero.locate(param)
        flat = self._check_value(slot, value, "safe_set_full_fp32_param")
        self.zero.check_not_gathered(group, "safe_set_full_fp32_param")
        part = param_part(master_range(group), slot)
        with torch.no_grad(), group.master_resident() as master:  # NVMe offload: written back to its file
            if part is not None:
                master[part[0] : part[1]].copy_(flat[part[2] : part[3]])
            group.write_shard()

    def set_full_optimizer_state(self, param: torch.Tensor, value: torch.Tensor, key: str) -> None:
        """Every rank passes the same whole ``value`` of state ``key``; each writes the part its leaves hold."""
        group, slot = self.zero.locate(param)
        flat = self._check_value(slot, value, "safe_set_full_optimizer_state")
        if not slot.trainable:
            raise ValueError(f"safe_set_full_optimizer_state: {slot.spec.name!r} is frozen and has no optimizer state")
        self._check_key(key, "safe_set_full_optimizer_state")
        part = param_part(master_range(group), slot)
        if part is not None:
            self._write_state(group, key, part[0], flat[part[2] : part[3]])

    def _write_state(self, group: ShardedGroup, key: str, lo: int, values: torch.Tensor) -> None:
        """Write ``values`` at master coordinate ``lo`` into the state of the leaves that cover it."""
        opt = self.host.optimizer
        assert opt is not None
        with self.host.optimizer_state_resident():  # written back to the swap file on exit
            for leaf_lo, leaf in self._leaves(group):
                hit = intersect((leaf_lo, leaf_lo + leaf.numel()), (lo, lo + values.numel()))
                state = opt.state.get(leaf, {}).get(key)
                if hit is not None and isinstance(state, torch.Tensor):
                    with torch.no_grad():
                        state[hit[0] - leaf_lo : hit[1] - leaf_lo].copy_(values[hit[0] - lo : hit[1] - lo])

    def set_full_grad(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Every rank passes the same whole fp32 ``value`` (as :meth:`full_grad` reads it: unscaled); each writes its
        part of the reduced gradient shard, which the next ``step`` (clipping included) uses. No collective."""
        group, slot = self.zero.locate(param)
        if not slot.trainable:
            raise ValueError(f"safe_set_full_grad: {slot.spec.name!r} is frozen and has no gradient")
        flat = self._check_value(slot, value, "safe_set_full_grad")
        part = param_part(grad_range(group), slot)
        if part is not None:
            with torch.no_grad():
                group.grad_shard[part[0] : part[1]].copy_(flat[part[2] : part[3]] * self.host.loss_scale)

    # --- this rank's part (no collective but write_shard's) ------------------------------------------------------
    def local_fp32(self, param: torch.Tensor) -> torch.Tensor | None:
        """This rank's part of the parameter's fp32 master, flattened (possibly empty; None for a frozen one)."""
        group, slot = self.zero.locate(param)
        if not slot.trainable:
            return None
        part = param_part(master_range(group), slot)
        with group.master_resident() as master:  # NVMe offload: read from its file
            return master[part[0] : part[1]].clone() if part else master.new_empty(0)

    def local_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """This rank's part of the reduced fp32 gradient, flattened (None for a frozen parameter)."""
        group, slot = self.zero.locate(param)
        if not slot.trainable:
            return None
        part = param_part(grad_range(group), slot)
        local = group.grad_shard[part[0] : part[1]] if part else group.grad_shard.new_empty(0)
        return local / self.host.loss_scale

    def local_optimizer_state(self, param: torch.Tensor, key: str) -> torch.Tensor | None:
        """This rank's part of optimizer state ``key``, flattened (None for a frozen parameter)."""
        group, slot = self.zero.locate(param)
        if not slot.trainable:
            return None
        self._check_key(key, "safe_get_local_optimizer_state")
        part = param_part(master_range(group), slot)
        return self._local_state(group, key)[part[0] : part[1]] if part else group.master.new_empty(0)

    def _check_local(
        self, group: ShardedGroup, slot: Slot, value: torch.Tensor, what: str
    ) -> tuple[tuple[int, int, int, int] | None, torch.Tensor]:
        part = param_part(master_range(group), slot)
        expected = 0 if part is None else part[1] - part[0]
        if value.numel() != expected:
            raise ValueError(
                f"{what}: value has {value.numel()} elements, this rank's part of {slot.spec.name!r} "
                f"has {expected} (see safe_get_local_fp32_param)"
            )
        return part, value.detach().reshape(-1)

    def set_local_fp32(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Write this rank's part (shaped as :meth:`local_fp32` returns it); every rank calls it (``write_shard``
        all-gathers at stages 1-2)."""
        group, slot = self.zero.locate(param)
        part, flat = self._check_local(group, slot, value, "safe_set_local_fp32_param")
        self.zero.check_not_gathered(group, "safe_set_local_fp32_param")
        with torch.no_grad(), group.master_resident() as master:  # NVMe offload: written back to its file
            if part is not None:
                master[part[0] : part[1]].copy_(flat)
            group.write_shard()

    def set_local_optimizer_state(self, param: torch.Tensor, value: torch.Tensor, key: str) -> None:
        """Write this rank's part of optimizer state ``key`` (shaped as :meth:`local_optimizer_state`)."""
        group, slot = self.zero.locate(param)
        if not slot.trainable:
            raise ValueError(f"safe_set_local_optimizer_state: {slot.spec.name!r} is frozen and has no optimizer state")
        part, flat = self._check_local(group, slot, value, "safe_set_local_optimizer_state")
        self._check_key(key, "safe_set_local_optimizer_state")
        if part is not None:
            self._write_state(group, key, part[0], flat)

    def set_local_grad(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Write this rank's part of the reduced gradient (shaped as :meth:`local_grad` returns it, unscaled)."""
        group, slot = self.zero.locate(param)
        if not slot.trainable:
            raise ValueError(f"safe_set_local_grad: {slot.spec.name!r} is frozen and has no gradient")
        part = param_part(grad_range(group), slot)
        expected = 0 if part is None else part[1] - part[0]
        if value.numel() != expected:
            raise ValueError(
                f"safe_set_local_grad: value has {value.numel()} elements, this rank's part of {slot.spec.name!r} "
                f"has {expected} (see safe_get_local_grad)"
            )
        if part is not None:
            with torch.no_grad():
                group.grad_shard[part[0] : part[1]].copy_(value.detach().reshape(-1) * self.host.loss_scale)

"""The sharded state of one gather group, in one explicit object.

State machine (``GroupState``)::

    SHARDED --start_gather()--> GATHERING --wait()--> GATHERED --release()--> SHARDED
       \\___________________________wait()__________________/^

Invariants (each tested):
* A GATHERING group holds exactly one :class:`PendingCollective`; nobody else holds it, and ``wait()``/``release()``
  complete it. There is no "in flight" without that handle.
* Parameters are views into the gathered buffer while GATHERED and size-0 placeholders otherwise (a stray use fails
  loudly instead of computing with stale data). Nothing is stored on the ``nn.Parameter`` objects.
* The replicated (persistent) group is always GATHERED: its buffer *is* its shard, on every rank.
* Every write to the shard goes through :meth:`ShardedGroup.write_shard` (invariant 5: one write path).
* Shapes come from the :class:`FlatLayout` metadata, never from the local shard's size.
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hybridzero.comm.collectives import Comm, PendingCollective
from hybridzero.zero.layout import FlatLayout, ParamSpec, build_layout, intersect


class GroupState(enum.Enum):
    """Where a group's full parameters are."""

    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


@dataclass(frozen=True)
class Slot:
    """One parameter of a group: the module's Parameter object and its place in the flat buffer."""

    param: nn.Parameter
    spec: ParamSpec
    trainable: bool


class ShardedGroup:
    """Flat, padded, sharded parameters of one gather group, with their gradient and master shards."""

    def __init__(self, index: int, name: str, owner: str | None, params: Sequence[tuple[str, nn.Parameter]],
                 comm: Comm, compute_dtype: torch.dtype, reduce_dtype: torch.dtype, device: torch.device) -> None:
        self.index = index
        self.name = name
        self.owner = owner
        self.comm = comm
        self.replicated = owner is None
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype
        self.device = device
        world = 1 if self.replicated else comm.world_size
        self.layout: FlatLayout = build_layout([n for n, _ in params], [p.shape for _, p in params], world)
        self.slots: tuple[Slot, ...] = tuple(Slot(p, spec, p.requires_grad)
                                             for (_, p), spec in zip(params, self.layout.specs))
        self.n_trainable = sum(s.trainable for s in self.slots)
        self.has_frozen = self.n_trainable < len(self.slots)
        self.state = GroupState.SHARDED
        self.handle: PendingCollective | None = None
        self.full: torch.Tensor | None = None
        self.grad_full: torch.Tensor | None = None
        self._grads_seen = 0
        self._placeholder = torch.empty(0, dtype=compute_dtype, device=device)
        self.master = self._init_master()
        self.shard = self.master if compute_dtype == torch.float32 else self.master.to(compute_dtype)
        self.grad_shard = torch.zeros(self.layout.shard_numel, dtype=torch.float32, device=device)
        if self.replicated:
            self.full = self.shard
            self._bind(self.shard)
            self.state = GroupState.GATHERED
        else:
            self._unbind()

    # --- construction -------------------------------------------------------------------------------------------
    def _init_master(self) -> torch.Tensor:
        """fp32 master shard from the module's current values, broadcast from rank 0 so every rank agrees."""
        flat = torch.zeros(self.layout.padded_numel, dtype=torch.float32, device=self.device)
        with torch.no_grad():
            for slot in self.slots:
                flat[slot.spec.offset:slot.spec.end].copy_(slot.param.detach().reshape(-1))
        self.comm.broadcast(flat, 0, phase="init")
        if self.replicated:
            return flat
        lo, hi = self.layout.shard_range(self.comm.rank)
        return flat[lo:hi].clone()

    # --- gather / release ---------------------------------------------------------------------------------------
    @property
    def numel(self) -> int:
        """Padded elements of the full buffer (what one gather moves)."""
        return self.layout.padded_numel

    def start_gather(self, phase: str) -> None:
        """Issue the all-gather asynchronously (SHARDED → GATHERING); no-op in any other state."""
        if self.state is not GroupState.SHARDED:
            return
        self.full = torch.empty(self.layout.padded_numel, dtype=self.compute_dtype, device=self.device)
        self.handle = self.comm.all_gather(self.full, self.shard, phase=phase, async_op=True)
        self.state = GroupState.GATHERING

    def wait(self, phase: str) -> None:
        """Make the full parameters available (any state → GATHERED)."""
        if self.state is GroupState.SHARDED:
            self.start_gather(phase)
        if self.state is GroupState.GATHERING:
            assert self.handle is not None and self.full is not None
            self.handle.wait()
            self.handle = None
            self._bind(self.full)
            self.state = GroupState.GATHERED

    def release(self) -> None:
        """Drop the full parameters (any state → SHARDED; a pending gather is completed first)."""
        if self.replicated or self.state is GroupState.SHARDED:
            return
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
        self._unbind()
        self.full = None
        self.state = GroupState.SHARDED

    def _bind(self, full: torch.Tensor) -> None:
        for slot in self.slots:
            slot.param.data = full[slot.spec.offset:slot.spec.end].view(slot.spec.shape)

    def _unbind(self) -> None:
        for slot in self.slots:
            slot.param.data = self._placeholder

    def is_quiescent(self) -> bool:
        """No gathered buffer (except the replicated group's), no pending handle, no unreduced gradient."""
        resting = GroupState.GATHERED if self.replicated else GroupState.SHARDED
        return self.state is resting and self.handle is None and self.grad_full is None

    # --- gradients ----------------------------------------------------------------------------------------------
    def accept_grad(self, slot_index: int, grad: torch.Tensor) -> bool:
        """Copy one parameter's gradient into the flat gradient buffer; True once every trainable one arrived."""
        if self.grad_full is None:
            self.grad_full = torch.zeros(self.layout.padded_numel, dtype=self.reduce_dtype, device=self.device)
            self._grads_seen = 0
        spec = self.slots[slot_index].spec
        self.grad_full[spec.offset:spec.end].copy_(grad.reshape(-1))
        self._grads_seen += 1
        return self._grads_seen == self.n_trainable

    def take_grad_full(self) -> torch.Tensor | None:
        """Hand the flat gradient buffer to the reducer (the group forgets it)."""
        grad, self.grad_full = self.grad_full, None
        self._grads_seen = 0
        return grad

    # --- the one write path (invariant 5) -----------------------------------------------------------------------
    def write_shard(self) -> None:
        """Propagate the master shard into the compute shard (and everything that caches it)."""
        if self.shard is not self.master:
            self.shard.copy_(self.master)

    # --- optimizer views ----------------------------------------------------------------------------------------
    def local_range(self, flat_range: tuple[int, int]) -> tuple[int, int] | None:
        """The part of a flat range this rank's shard holds, in shard coordinates."""
        if self.replicated:
            return intersect((0, self.layout.padded_numel), flat_range)
        return self.layout.local_ranges(self.comm.rank, flat_range)

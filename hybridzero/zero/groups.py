"""The sharded state of one gather group, in one explicit object.

State machine (``GroupState``)::

    SHARDED --start_gather()--> GATHERING --wait()--> GATHERED --release()--> SHARDED
       \\___________________________wait()__________________/^

Invariants (each tested):
* A GATHERING group holds exactly one :class:`PendingCollective`; nobody else holds it, and ``wait()``/``release()``
  complete it. There is no "in flight" without that handle.
* Parameters are views into the gathered buffer while GATHERED and size-0 placeholders otherwise (a stray use fails
  loudly instead of computing with stale data). Nothing is stored on the ``nn.Parameter`` objects.
* Only ZERO3 groups ever leave GATHERED through ``release``: every group of ZeRO stages 0–2 keeps its parameters
  whole on every rank (its flat buffer is always bound). The persistent group is whole except after
  :meth:`ShardedGroup.evict` (``engine.empty_partition_cache()``, as DeepSpeed frees persistent parameters there):
  SHARDED then, with the whole master kept, and ``wait`` rebinds it from that master locally (no collective, so
  any rank may do it at any time).
* Modes (:class:`ShardMode`): ``ZERO3`` shards parameters, gradients and master weights; ``PARAMS_WHOLE``
  (stages 1 and 2) shards gradients and master weights and all-gathers the updated parameters after each step;
  ``DDP`` (stage 0) reduces gradients through shards, then all-gathers them and steps a whole master copy on every
  rank; ``PERSISTENT`` (small parameters at stage 3) keeps everything whole (layout over one rank).
* Every write to the shard goes through :meth:`ShardedGroup.write_shard` (one write path).
* ZeRO-Infinity (:mod:`hybridzero.zero.infinity`): the master may live in a file, ``master`` then being an empty
  placeholder outside ``master_resident()``; the kept compute shard always equals the master cast.
* Shapes come from the :class:`FlatLayout` metadata, never from the local shard's size.

One group's whole lifecycle (gather, release, gradient buffer, shard write) is one state object by design (DESIGN.md:
a parameter's sharded state lives in one explicit object); the file-backed master lives apart in
:mod:`hybridzero.zero.infinity`, and the group's vocabulary (``ShardMode``, ``stage_mode``, ``GroupState``, ``Slot``)
in :mod:`hybridzero.zero.group_types`, re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from hybridzero.comm.collectives import Comm, PendingCollective
from hybridzero.comm.quantize import (
    dequantize_blockwise,
    from_wire,
    quantize_blockwise,
    to_wire,
)
from hybridzero.tensor_source import TensorSource
from hybridzero.zero.fill import read_range
from hybridzero.zero.group_types import GroupState, ShardMode, Slot, stage_mode
from hybridzero.zero.infinity import FileBackedMaster
from hybridzero.zero.layout import FlatLayout, build_layout, intersect
from hybridzero.zero.offload import Placement, move
from hybridzero.zero.registry import full_shape

__all__ = ["GroupState", "ShardMode", "ShardedGroup", "Slot", "stage_mode"]


class ShardedGroup(FileBackedMaster):
    """Flat, padded, sharded parameters of one gather group, with their gradient and master shards (with
    ZeRO-Infinity's files through :class:`FileBackedMaster`)."""

    def __init__(
        self,
        index: int,
        name: str,
        owner: str | None,
        params: Sequence[tuple[str, nn.Parameter]],
        comm: Comm,
        compute_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        device: torch.device,
        mode: ShardMode = ShardMode.ZERO3,
        source: TensorSource | None = None,
        aliases: Mapping[str, Sequence[str]] | None = None,
        hpz: Comm | None = None,
        quantize_block: int | None = None,
        placement: Placement | None = None,
    ) -> None:
        self.index = index
        self._timer = comm.ledger.timer  # the step profile (off unless a benchmark turns it on)
        # master, gradient shard (and so the optimizer state) live on the placement's host (ZeRO-Offload)
        self.placement = placement or Placement.build(device)
        self.host = self.placement.host
        self.name = name
        self.owner = owner if mode is ShardMode.ZERO3 else None
        self.comm = comm
        self.mode = mode
        self.replicated = mode is ShardMode.PERSISTENT  # layout over one rank; gradients all-reduced
        self.always_full = mode is not ShardMode.ZERO3
        self.master_is_whole = mode in (ShardMode.DDP, ShardMode.PERSISTENT)
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype
        self.device = device
        world = 1 if self.replicated else comm.world_size
        self.layout: FlatLayout = build_layout([n for n, _ in params], [full_shape(p) for _, p in params], world)
        self.slots: tuple[Slot, ...] = tuple(
            Slot(p, spec, p.requires_grad) for (_, p), spec in zip(params, self.layout.specs)
        )
        self.n_trainable = sum(s.trainable for s in self.slots)
        self.has_frozen = self.n_trainable < len(self.slots)
        self._untrained = self._untrained_ranges()  # zeroed in a new flat gradient (no trainable slot writes them)
        self.state = GroupState.SHARDED
        self.handle: PendingCollective | None = None
        self.full: torch.Tensor | None = None
        self.grad_full: torch.Tensor | None = None
        self._grads_seen: set[int] = set()
        self.pins = 0  # open GatheredParameters blocks holding this group gathered
        # hpZ: a node-local secondary shard, a cache of the gathered buffer, valid only for `version`
        self.hpz = hpz if mode is ShardMode.ZERO3 and hpz is not None and hpz.world_size > 1 else None
        self.version = 0  # bumped by every write to the master (write_shard)
        self.secondary: torch.Tensor | None = None
        self.secondary_version = -1
        # qwZ: primary gathers move block-int8 weights (dequantized into the compute buffer on arrival)
        self.quantize_block = quantize_block if mode is ShardMode.ZERO3 else None
        self._decode: Callable[[], None] | None = None
        self._init_buffers(source, aliases or {})

    # --- construction -------------------------------------------------------------------------------------------
    def _init_buffers(self, source: TensorSource | None, aliases: Mapping[str, Sequence[str]]) -> None:
        """The master, the gradient shard and (for the always-full modes) the gathered compute buffer."""
        self._placeholder = torch.empty(0, dtype=self.compute_dtype, device=self.device)
        whole_master = self.master_is_whole
        self.master = self._init_master(source, aliases, whole_master)
        self.init_files()  # ZeRO-Infinity (zero/infinity.py): none until offload_to_files
        self._send: torch.Tensor | None = None  # the gather's input, alive until the gather completed
        # A group of frozen parameters only (LoRA's base: zero/partition.py splits mixed blocks) has no gradient
        # bytes at all; every other group keeps whole, equal-sized gradient shards on every rank.
        frozen_only = self.n_trainable == 0 and self.mode is not ShardMode.DDP
        self.grad_shard = self._host_zeros(0 if frozen_only else self.layout.shard_numel)
        # DDP steps the whole master copy: its gradient is the all-gathered grad shards (assembled at step time).
        ddp = self.mode is ShardMode.DDP
        self.opt_grad = self._host_zeros(self.layout.padded_numel) if ddp else self.grad_shard
        if self.always_full:
            self.full = self.compute_shard() if whole_master else self._gathered_copy(self.compute_shard())
            self._bind(self.full)
            self.state = GroupState.GATHERED
        else:
            self._unbind()

    def _host_zeros(self, numel: int) -> torch.Tensor:
        pin = self.placement.pin_memory and self.host.type == "cpu"
        return torch.zeros(numel, dtype=torch.float32, device=self.host, pin_memory=pin)

    def _init_master(
        self, source: TensorSource | None, aliases: Mapping[str, Sequence[str]], whole: bool
    ) -> torch.Tensor:
        """fp32 master (this rank's shard, or the whole buffer when ``whole``).

        From the module's current values, broadcast from rank 0 so every rank agrees; or, with ``source`` (a
        checkpoint), each rank reads only the elements it owns, so no rank ever holds more than its part.
        """
        lo, hi = (0, self.layout.padded_numel) if whole else self.layout.shard_range(self.comm.rank)
        if source is not None:
            return self._to_host(read_range(self.layout.specs, lo, hi, source, aliases))
        flat = torch.zeros(self.layout.padded_numel, dtype=torch.float32, device=self.device)
        with torch.no_grad():
            for slot in self.slots:
                flat[slot.spec.offset : slot.spec.end].copy_(slot.param.detach().reshape(-1))
        self.comm.broadcast(flat, 0, phase="init")
        return self._to_host(flat if whole else flat[lo:hi].clone())

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        return move(t, self.host, torch.float32, self.placement.pin_memory)

    def _gathered_copy(self, shard: torch.Tensor, phase: str = "init") -> torch.Tensor:
        full = torch.empty(self.layout.padded_numel, dtype=self.compute_dtype, device=self.device)
        self.comm.all_gather(full, shard, phase=phase)
        return full

    # --- gather / release ---------------------------------------------------------------------------------------
    @property
    def numel(self) -> int:
        """Padded elements of the full buffer (what one gather moves)."""
        return self.layout.padded_numel

    def start_gather(self, phase: str) -> None:
        """Issue the all-gather asynchronously (SHARDED → GATHERING); no-op in any other state. An evicted
        persistent group is rebound from its whole master instead (SHARDED → GATHERED, no collective)."""
        if self.state is not GroupState.SHARDED:
            return
        if self.replicated:
            self.full = self.compute_shard()
            self._bind(self.full)
            self.state = GroupState.GATHERED
            return
        self.full = torch.empty(self.layout.padded_numel, dtype=self.compute_dtype, device=self.device)
        if self.secondary_valid():
            assert self.hpz is not None and self.secondary is not None
            self._send = self.secondary  # node-local gather: never leaves the node
            self.handle = self.hpz.all_gather(self.full, self._send, phase=phase, async_op=True)
        elif self.quantize_block is not None:
            self._start_quantized_gather(phase)
        else:
            with self._timer.region("copy.cast"):
                self._send = self.compute_shard()
            self.handle = self.comm.all_gather(self.full, self._send, phase=phase, async_op=True)
        self.state = GroupState.GATHERING

    def _start_quantized_gather(self, phase: str) -> None:
        """qwZ: every rank sends its shard as block-int8 (+ fp32 scales); ``wait`` dequantizes each rank's part.
        Deterministic: the forward and any re-gather of the same master see identical values."""
        assert self.full is not None and self.quantize_block is not None
        shard_numel, block, full = self.layout.shard_numel, self.quantize_block, self.full
        wire = to_wire(quantize_blockwise(self.compute_shard(), bits=8, block=block))
        recv = torch.empty(self.comm.world_size * wire.numel(), dtype=torch.uint8, device=self.device)
        self._send = wire
        self.handle = self.comm.all_gather(recv, wire, phase=phase, async_op=True)

        def decode() -> None:
            n = wire.numel()
            for r in range(self.comm.world_size):
                q = from_wire(recv[r * n : (r + 1) * n], shard_numel, 8, block)
                dequantize_blockwise(q, out=full[r * shard_numel : (r + 1) * shard_numel])

        self._decode = decode

    def join_coalesced(
        self, handle: PendingCollective, send: torch.Tensor, recv: torch.Tensor, offset: int, stride: int
    ) -> None:
        """SHARDED → GATHERING on a shared, coalesced all-gather (:mod:`hybridzero.zero.coalesce`): ``recv`` holds
        ``world`` chunks of ``stride`` elements, this group's shard at ``offset`` in each; ``wait`` copies them
        out rank by rank into this group's own full buffer (bit-identical to a gather of its own)."""
        assert self.state is GroupState.SHARDED
        full = torch.empty(self.layout.padded_numel, dtype=self.compute_dtype, device=self.device)
        size, world = self.layout.shard_numel, self.comm.world_size
        self.full, self.handle, self._send = full, handle, send

        def decode() -> None:
            full.view(world, size).copy_(recv.view(world, stride)[:, offset : offset + size])

        self._decode = decode
        self.state = GroupState.GATHERING

    def wait(self, phase: str) -> None:
        """Make the full parameters available (any state → GATHERED)."""
        if self.state is GroupState.SHARDED:
            self.start_gather(phase)
        if self.state is GroupState.GATHERING:
            assert self.handle is not None and self.full is not None
            self.handle.wait()
            self.handle = None
            self._send = None
            if self._decode is not None:
                with self._timer.region("copy.unpack"):
                    self._decode()
                self._decode = None
            self._bind(self.full)
            self.state = GroupState.GATHERED

    def evict(self) -> None:
        """Persistent group only, unpinned and whole: drop its bound buffer (GATHERED → SHARDED, parameters become
        size-0 placeholders); the whole master stays, and the next ``wait`` rebinds from it. No-op otherwise."""
        if not self.replicated or self.pins or self.state is not GroupState.GATHERED:
            return
        self._unbind()
        self.full = None
        self.state = GroupState.SHARDED

    def release(self) -> None:
        """Drop the full parameters (any state → SHARDED; a pending gather is completed first)."""
        if self.always_full or self.state is GroupState.SHARDED:
            return
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
            self._send = None
            self._decode = None
        self._unbind()
        self.full = None
        self.state = GroupState.SHARDED

    def _bind(self, full: torch.Tensor) -> None:
        for slot in self.slots:
            slot.param.data = full[slot.spec.offset : slot.spec.end].view(slot.spec.shape)

    def _unbind(self) -> None:
        for slot in self.slots:
            slot.param.data = self._placeholder

    def is_quiescent(self) -> bool:
        """No gathered buffer (except the whole groups', or the evicted persistent group), no pending handle, no
        unreduced gradient."""
        resting = GroupState.GATHERED if self.always_full else GroupState.SHARDED
        evicted = self.replicated and self.state is GroupState.SHARDED
        return (self.state is resting or evicted) and self.handle is None and self.grad_full is None

    # --- gradients ----------------------------------------------------------------------------------------------
    def accept_grad(self, slot_index: int, grad: torch.Tensor) -> bool:
        """Put one parameter's gradient into the flat gradient buffer; True once every trainable one arrived.

        One pass per gradient: the first delivery of a slot is copied into its range, a second one (a parameter used
        twice may deliver twice) added. Only the ranges no trainable slot covers (alignment gaps, tail padding,
        frozen slots) are zeroed when the buffer is made, and trainable slots that never delivered are zeroed when
        the buffer is taken. Every element equals the zero-filled-then-added buffer's, except that a gradient's
        ``-0.0`` stays ``-0.0``; the reduction then adds it to a ``+0.0`` or a nonzero value, so the gradient
        shard is bitwise the same."""
        with self._timer.region("copy.grad"):
            if self.grad_full is None:
                self.grad_full = torch.empty(self.layout.padded_numel, dtype=self.reduce_dtype, device=self.device)
                for lo, hi in self._untrained:
                    self.grad_full[lo:hi].zero_()
                self._grads_seen = set()
            spec = self.slots[slot_index].spec
            dst = self.grad_full[spec.offset : spec.end]
            if slot_index in self._grads_seen:
                dst.add_(grad.reshape(-1))
            else:
                dst.copy_(grad.reshape(-1))
        self._grads_seen.add(slot_index)
        return len(self._grads_seen) == self.n_trainable

    def _untrained_ranges(self) -> list[tuple[int, int]]:
        """The flat ranges no trainable slot covers, in order (the complement of the trainable slots' ranges)."""
        out, at = [], 0
        for spec in sorted((s.spec for s in self.slots if s.trainable), key=lambda sp: sp.offset):
            if spec.offset > at:
                out.append((at, spec.offset))
            at = max(at, spec.end)
        if at < self.layout.padded_numel:
            out.append((at, self.layout.padded_numel))
        return out

    def take_grad_full(self) -> torch.Tensor | None:
        """Hand the flat gradient buffer to the reducer (the group forgets it); trainable slots that delivered no
        gradient in this backward read as zeros."""
        grad, self.grad_full = self.grad_full, None
        if grad is not None:
            for i, slot in enumerate(self.slots):
                if slot.trainable and i not in self._grads_seen:
                    grad[slot.spec.offset : slot.spec.end].zero_()
        self._grads_seen = set()
        return grad

    # --- the one write path -----------------------------------------------------------------------------------
    # --- hpZ secondary shard (a cache of the primary, never stale) --------------------------------------------------
    def secondary_valid(self) -> bool:
        """A secondary exists and was built from the current master version."""
        return self.secondary is not None and self.secondary_version == self.version

    def build_secondary(self) -> None:
        """Keep this rank's 1/h of the exact buffer the forward used (h = hpZ group size)."""
        if self.hpz is None or self.state is not GroupState.GATHERED or self.secondary_valid():
            return
        assert self.full is not None
        part = self.layout.padded_numel // self.hpz.world_size
        self.secondary = self.full[self.hpz.rank * part : (self.hpz.rank + 1) * part].clone()
        self.secondary_version = self.version

    def drop_secondary(self) -> None:
        """Forget the secondary shard (end of backward, or the master changed)."""
        self.secondary = None
        self.secondary_version = -1

    def absorb_full(self, slots: Sequence[Slot]) -> None:
        """Take the values of ``slots`` from the gathered buffer into the master (``GatheredParameters`` with a
        modifier), then propagate through :meth:`write_shard`. Only the named slots are read, so the master of
        every other parameter keeps its full precision."""
        assert self.full is not None and self.state is GroupState.GATHERED
        lo, hi = (0, self.layout.padded_numel) if self.master_is_whole else self.layout.shard_range(self.comm.rank)
        with self.master_resident() as master:
            for slot in slots:
                hit = intersect((lo, hi), (slot.spec.offset, slot.spec.end))
                if hit is not None:
                    master[hit[0] - lo : hit[1] - lo].copy_(self.full[hit[0] : hit[1]])
            self.write_shard()

    def write_shard(self) -> None:
        """Propagate the master into everything derived from it: for groups whose parameters stay whole, the
        bound full buffer (all-gathered from the updated shards, or copied from a whole master). ZeRO-3 compute
        shards are cast from the master at each gather; an hpZ secondary is invalidated (version bump) and dropped.
        With the master in a file, the kept compute shard is re-derived from a resident master (the streamed
        optimizer step updates it piecewise instead, :meth:`update_compute`)."""
        self.version += 1
        self.drop_secondary()
        self.refresh_compute()
        if self.mode is ShardMode.PARAMS_WHOLE:
            assert self.full is not None
            self.comm.all_gather(self.full, self.compute_shard(), phase="step")
        elif self.master_is_whole and self.full is not None and self.full is not self.master:
            self.full.copy_(self.master)  # an evicted persistent group (no buffer) is rebound from the master later

    def compute_shard(self) -> torch.Tensor:
        """This rank's part in the compute dtype: the master itself in fp32, else a fresh cast (mixed precision
        keeps no second copy of the shard: model states stay at 16 bytes per parameter / N with Adam). With the master
        offloaded to the host this is the copy that brings the shard to the device for the gather; with the master
        in a file it is the kept compute shard, read from its file with ``offload_param: nvme``."""
        kept = self.kept_shard()
        return kept if kept is not None else move(self.master, self.device, self.compute_dtype)

    def assemble_grad(self) -> None:
        """DDP only: the whole reduced gradient from every rank's grad shard (before clipping and stepping)."""
        if self.mode is ShardMode.DDP:
            self.comm.all_gather(self.opt_grad, self.grad_shard, phase="step")

    # --- optimizer views ----------------------------------------------------------------------------------------
    def local_range(self, flat_range: tuple[int, int]) -> tuple[int, int] | None:
        """The part of a flat range this rank's master holds, in master coordinates."""
        if self.master_is_whole:
            return intersect((0, self.layout.padded_numel), flat_range)
        return self.layout.local_ranges(self.comm.rank, flat_range)

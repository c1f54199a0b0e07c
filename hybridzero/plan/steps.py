"""Predicted collectives of training steps and of hybrid generation: the ledger a run will record, per rank.

:class:`StepSimulator` replays the coordinator's rules (``zero/coordinator.py``) on :class:`GroupShape` metadata:
the root group is used at the root pre-forward, each block's groups around the block's forward; a block's groups
are kept for the backward by DeepSpeed's reuse rule (``stage3_max_reuse_distance`` or the prefetch bucket,
``stage3_max_live_parameters``)
or released (building an hpZ secondary first); the backward uses the root once per output tensor that requires grad
(``root_outputs``: a causal LM called with labels returns loss and logits) and the blocks in reverse order,
reducing each group once all its trainable gradients arrived. The trace-based prefetch is the engine's own
:class:`~hybridzero.zero.prefetch.Prefetcher`, fed the same group ids, and its batches are coalesced into one
all-gather as ``zero/coalesce.py`` does; gradient buckets follow ``zero/reduce.py`` (``reduce_bucket_size`` columns
of ``W`` rows; qgZ as ``zero/qgz.py``'s two quantized stages); the step issues the overflow / skip flag, the clip
norm and the stage-0 and stage-1/2 all-gathers as ``Engine._apply_update`` does.

Every call is recorded into a :class:`~hybridzero.comm.ledger.Ledger` with the byte rules of
``comm/collectives.py`` (``bytes``: the collective's whole buffer; ``wire_bytes``: what one rank sends on a ring).
Invariant (tested at world 1-4 against the engine's ledger): the prediction equals what the engine records for the
same steps, call for call and byte for byte, from the first step on (the first step has no prefetch trace yet).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from hybridzero.comm.ledger import Ledger
from hybridzero.comm.quantize import quantized_nbytes
from hybridzero.config import Config
from hybridzero.plan.layout import GroupShape
from hybridzero.zero.group_types import ShardMode
from hybridzero.zero.prefetch import Prefetcher

__all__ = ["StepSimulator", "Topology", "generation_ledger", "wire_bytes"]


class _State(enum.Enum):
    SHARDED = 0
    GATHERING = 1
    GATHERED = 2


@dataclass(frozen=True)
class Topology:
    """Ranks and nodes: ``world`` ranks, ``local`` per node (torchrun's ``LOCAL_WORLD_SIZE``)."""

    world: int
    local: int

    @property
    def nodes(self) -> int:
        """Number of nodes."""
        return self.world // self.local


def wire_bytes(collective: str, nbytes: int, world: int) -> int:
    """Bytes one rank sends on a ring, as ``comm/collectives.py`` records them (broadcasts: the root's view)."""
    if collective in ("all_gather", "grad_all_gather", "reduce_scatter"):
        return nbytes * (world - 1) // world
    if collective == "all_reduce":
        return 2 * nbytes * (world - 1) // world
    if collective == "broadcast":
        return nbytes if world > 1 else 0
    return 0


@dataclass
class _Group:
    shape: GroupShape
    state: _State = _State.SHARDED
    secondary: bool = False

    @property
    def numel(self) -> int:
        return self.shape.layout.padded_numel


@dataclass
class StepSimulator:
    """Replays training steps over ``groups`` (see module docstring); ``ledger`` collects what they issue."""

    groups: Sequence[GroupShape]
    cfg: Config
    topo: Topology
    root_outputs: int = 2
    block_outputs: int = 1
    ledger: Ledger = field(default_factory=Ledger)
    peak_gathered_bytes: int = 0

    def __post_init__(self) -> None:
        z = self.cfg.zero
        self.state = [_Group(g) for g in self.groups]
        self.prefetcher = Prefetcher(z.prefetch_bucket_size, z.max_live_parameters, z.max_reuse_distance)
        self.item = self.cfg.compute_dtype.itemsize
        self.reduce_item = self.cfg.communication_dtype.itemsize
        self.hpz = z.hpz_partition_size if z.stage == 3 and z.hpz_partition_size > 1 else 1
        self.kept: set[int] = set()
        self._pending_cols = 0
        self._pieces: list[tuple[int, bool]] = []  # (columns, whole group) of the bucket being filled
        self._replicated = 0  # elements of persistent-group gradients waiting for the drain
        self._replicated_calls = 0
        self.prefetched = 0  # gathers launched ahead of use by the prefetcher (overlap is possible only for these)

    # --- recording ----------------------------------------------------------------------------------------------
    def _record(self, collective: str, group: str, phase: str, nbytes: int) -> None:
        world = {"world": self.topo.world, "hpz": self.hpz, "node": self.topo.local, "cross": self.topo.nodes}[group]
        self.ledger.record(collective, group, phase, nbytes, wire_bytes(collective, nbytes, world))

    # --- gathers ------------------------------------------------------------------------------------------------
    def _live(self, state: tuple[_State, ...]) -> int:
        return sum(g.numel for g in self.state if not g.shape.always_full and g.state in state)

    def _start_gather(self, g: _Group, phase: str) -> None:
        if g.state is not _State.SHARDED:
            return
        shape = g.shape
        if g.secondary:
            self._record("all_gather", "hpz", phase, g.numel * self.item)
        elif shape.quantize_block is not None:
            wire = quantized_nbytes(shape.layout.shard_numel, bits=8, block=shape.quantize_block)
            self._record("all_gather", "world", phase, self.topo.world * wire)
        else:
            self._record("all_gather", "world", phase, g.numel * self.item)
        g.state = _State.GATHERING

    def _start_gathers(self, batch: list[_Group], phase: str) -> None:
        """``zero/coalesce.py::start_gathers``."""
        eligible = [
            g
            for g in batch
            if g.state is _State.SHARDED
            and not g.shape.always_full
            and not g.secondary
            and g.shape.quantize_block is None
        ]
        if len(eligible) < 2 or self.topo.world == 1:  # one rank: a gather is a local copy, never coalesced
            for g in batch:
                self._start_gather(g, phase)
            return
        total = sum(g.shape.layout.shard_numel for g in eligible)
        self._record("all_gather", "world", phase, self.topo.world * total * self.item)
        for g in eligible:
            g.state = _State.GATHERING
        for g in batch:
            if not any(g is e for e in eligible):
                self._start_gather(g, phase)

    def _use(self, g: _Group, kind: str) -> None:
        """``ZeroCoordinator.use``."""
        upcoming = self.prefetcher.observe(g.shape.index) if self.prefetcher.active_kind == kind else []
        if upcoming and self.prefetcher.enabled:
            self._prefetch(upcoming, g, kind)
        if g.state is _State.SHARDED:
            self._start_gather(g, kind)
        g.state = _State.GATHERED
        live = self._live((_State.GATHERING, _State.GATHERED)) * self.item
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, live)

    def _prefetch(self, upcoming: list[int], current: _Group | None, kind: str) -> None:
        """``ZeroCoordinator._prefetch`` (``current`` None: ``prefetch_ahead``, a root without parameters)."""
        inflight = self._live((_State.GATHERING,))
        live = self._live((_State.GATHERING, _State.GATHERED))
        batch: list[_Group] = [current] if current is not None and current.state is _State.SHARDED else []
        for gid in upcoming:
            cand = self.state[gid]
            if cand is current or cand.state is not _State.SHARDED or any(c is cand for c in batch):
                continue
            if (
                inflight + cand.numel > self.prefetcher.bucket_elems
                or live + cand.numel > self.prefetcher.max_live_elems
            ):
                break
            batch.append(cand)
            self.prefetched += 1
            inflight += cand.numel
            live += cand.numel
        if len(batch) > (1 if batch and batch[0] is current else 0):
            self._start_gathers(batch, kind)

    def _release(self, g: _Group) -> None:
        if not g.shape.always_full:
            g.state = _State.SHARDED

    def _end_phase(self, keep: set[int] | None = None) -> None:
        self.kept = set(keep or ())
        for g in self.state:
            if g.shape.index not in self.kept:
                self._release(g)
        self.prefetcher.end()

    def _keep_for_backward(self, g: _Group) -> bool:
        if g.shape.always_full:
            return False
        distance = self.prefetcher.distance_to_end(lambda gid: self.state[gid].numel)
        if distance is None or distance >= self.prefetcher.keep_distance:
            return False
        return self._live((_State.GATHERING, _State.GATHERED)) <= self.prefetcher.max_live_elems

    def _build_secondary(self, g: _Group) -> None:
        if self.hpz > 1 and not g.shape.always_full and g.state is _State.GATHERED:
            g.secondary = True

    # --- phases -------------------------------------------------------------------------------------------------
    def _blocks(self) -> list[list[_Group]]:
        order: dict[str, list[_Group]] = {}
        for g in self.state:
            if g.shape.owner:
                order.setdefault(g.shape.owner, []).append(g)
        return list(order.values())

    def _root(self) -> _Group | None:
        return next((g for g in self.state if g.shape.owner == ""), None)

    def forward(self, grad: bool = True) -> None:
        """One forward; with ``grad`` a training forward (reuse rule, hpZ secondaries), else inference."""
        root = self._root()
        self.prefetcher.begin("forward")
        if root is not None:
            self._use(root, "forward")
        elif self.prefetcher.enabled and self.prefetcher.upcoming():
            self._prefetch(self.prefetcher.upcoming(), None, "forward")  # ``ZeroCoordinator.prefetch_ahead``
        for block in self._blocks():
            for g in block:
                self._use(g, "forward")
            for g in block:
                if grad and self._keep_for_backward(g):
                    self.kept.add(g.shape.index)
                    continue
                if grad:
                    self._build_secondary(g)
                if not self.prefetcher.reused_soon(g.shape.index, lambda gid: self.state[gid].numel):
                    self._release(g)
        keep = set(self.kept)
        if root is not None and grad:
            if self._keep_for_backward(root):
                keep.add(root.shape.index)
            else:
                self._build_secondary(root)
        self._end_phase(keep if grad else None)

    def backward(self) -> None:
        """One backward: gathers in reverse, gradient buckets, the drain."""
        root = self._root()
        self.prefetcher.begin("backward")
        if root is not None:
            for _ in range(self.root_outputs):
                self._use(root, "backward")
        blocks = self._blocks()
        root_grads = root is not None and root.shape.n_trainable > 0
        for i, block in reversed(list(enumerate(blocks))):
            for _ in range(self.block_outputs):
                for g in block:
                    self._use(g, "backward")
            for g in block:
                if g.shape.n_trainable > 0:
                    self._submit(g.shape)
                    if not g.shape.has_frozen:
                        self._release(g)
                elif i > 0 or root_grads:  # the block's input gradient completes: frozen groups released
                    self._release(g)
        for g in self.state:  # root last (the embedding's gradient is the last), stages 0-2 in any order
            if g.shape.n_trainable > 0 and not g.shape.owner:
                self._submit(g.shape)
        self._drain()
        for g in self.state:
            g.secondary = False
        self._end_phase()
        z = self.cfg.zero
        if z.stage in (1, 2) and not z.ignore_unused_parameters:
            self._record("all_gather_object", "world", "backward", 0)

    def _submit(self, shape: GroupShape) -> None:
        """``GradReducer.submit``: whole columns into buckets of ``reduce_bucket_size // W`` columns; a group that
        fits in a bucket starts a new one rather than being split (not under qgZ, which keeps its packing)."""
        if shape.replicated:
            self._replicated += shape.layout.padded_numel
            self._replicated_calls += 1
            return
        cap = max(1, self.cfg.zero.reduce_bucket_size // self.topo.world)
        cols = total = shape.layout.shard_numel
        if not self.cfg.zero.quantized_gradients and self._pending_cols and self._pending_cols + total > cap:
            self._flush()
        while cols > 0:
            take = min(cols, cap - self._pending_cols)
            # a [W, take] column slice of the group's [W, total] gradient is contiguous when whole (or W == 1)
            self._pieces.append((take, take == total or self.topo.world == 1))
            self._pending_cols += take
            cols -= take
            if self._pending_cols >= cap:
                self._flush()

    def _flush(self) -> None:
        """``GradReducer.flush``: one exchange per whole-group piece, one packed exchange for the split pieces."""
        cols, self._pending_cols = self._pending_cols, 0
        pieces, self._pieces = self._pieces, []
        if cols == 0:
            return
        z = self.cfg.zero
        if not z.quantized_gradients:
            split = sum(take for take, whole in pieces if not whole)
            for take in [take for take, whole in pieces if whole] + ([split] if split else []):
                self._record("reduce_scatter", "world", "backward", self.topo.world * take * self.reduce_item)
            return
        bits, block, local, nodes = (
            z.quantized_gradients_bits,
            z.quantization_block_size,
            self.topo.local,
            self.topo.nodes,
        )
        self._record(
            "reduce_scatter", "node", "backward", local * quantized_nbytes(nodes * cols, bits=bits, block=block)
        )
        if nodes > 1:
            self._record("reduce_scatter", "cross", "backward", nodes * quantized_nbytes(cols, bits=bits, block=block))

    def _drain(self) -> None:
        self._flush()
        for _ in range(self._replicated_calls):
            self._record("grad_all_gather", "world", "backward", self.topo.world * self._replicated * self.reduce_item)
        self._replicated, self._replicated_calls = 0, 0

    def optimizer_step(self) -> None:
        """``Engine._apply_update`` at the accumulation boundary (no overflow)."""
        if self.cfg.fp16.enabled or self.cfg.skip_nonfinite_steps:
            self._record("all_reduce", "world", "step", 4)  # the float32 overflow flag, MAX
        self._record("all_reduce", "world", "step", 8)  # the fp64 sum of squares (the norm, clipping or not)
        for g in self.state:
            shape = g.shape
            if shape.n_trainable == 0:
                continue
            if shape.mode is ShardMode.DDP:
                self._record("all_gather", "world", "step", 4 * shape.layout.padded_numel)
            elif shape.mode is ShardMode.PARAMS_WHOLE:
                self._record("all_gather", "world", "step", self.item * shape.layout.padded_numel)

    def inference_forward(self) -> Ledger:
        """One ``no_grad`` forward (experience making: reference, reward, critic values); returns its ledger."""
        mark = self.ledger.copy()
        self.forward(grad=False)
        return self.ledger.since(mark)

    def generation(self) -> Ledger:
        """Hybrid-engine generation from a quiescent engine: each ZeRO-3 group's own gather, all released on exit."""
        mark = self.ledger.copy()
        for g in self.state:
            if not g.shape.always_full:
                self._start_gather(g, "generate")
        self._end_phase()
        return self.ledger.since(mark)

    def train_step(self) -> Ledger:
        """One optimizer step (``gradient_accumulation_steps`` forward/backward pairs); returns its ledger."""
        mark = self.ledger.copy()
        for _ in range(self.cfg.gradient_accumulation_steps):
            self.forward()
            self.backward()
        self.optimizer_step()
        return self.ledger.since(mark)


def generation_ledger(groups: Sequence[GroupShape], cfg: Config, topo: Topology) -> Ledger:
    """``runtime/hybrid.py::generation_mode``: every ZeRO-3 group gathered once (qwZ quantized), then no
    collective until exit."""
    return StepSimulator(groups, cfg, topo).generation()

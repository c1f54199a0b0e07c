"""Gradient reduction: bucketed reduce-scatter of flat group gradients into fp32 gradient shards.

A group's flat gradient ``[W * S]`` is viewed as ``[W, S]`` (row ``r`` = rank ``r``'s slice). Pieces of whole
columns from one or more groups fill a bucket of at most ``reduce_bucket_size`` elements (a group that fits is never
split over two); a flush exchanges each whole-group piece straight from its buffer and the split pieces as one packed
rank-major copy, and the exchange gives every rank the sum of its columns, which is scaled by :class:`ReductionScales`
and added into the group's fp32 ``grad_shard`` (so accumulation across micro-steps is a plain sum).

Scaling (DeepSpeed's ``gradient_allreduce_op``, ``prescale_gradients``, ``gradient_predivide_factor``; see
:func:`reduction_scales`): each rank's contribution may be divided by ``pre`` before the exchange and the sum by
``post`` after it. The rule that replaces "divide exactly once": with the defaults (``mean``, no prescale,
predivide 1) the sum is divided by the world size exactly once, after the sum, as before; for ``mean`` the divisors
applied multiply to the world size ``W``, and each is applied at most once per element. ``sum`` is the plain
rank-ordered sum, untouched: DeepSpeed's ``sum`` (``gradient_average = False``) all-reduces without any division and
ignores ``prescale_gradients`` and ``gradient_predivide_factor`` (``DeepSpeedEngine.allreduce_bucket``,
``DeepSpeedZeroOptimizer.gradient_reduction_w_predivide`` / ``average_tensor``).

The reduction is order-deterministic: the transport only exchanges slices (an all-to-all that moves exactly a
reduce-scatter's bytes) and every rank sums the ``W`` contributions for its columns in rank order, in fp32. The
result is therefore bitwise independent of the transport's algorithm and reproducible by a single process that
sums the per-rank gradients in the same order (our reference runner does exactly that).

Invariants:
* The order of collectives depends only on the order in which groups are submitted (the autograd order, equal on
  every rank for the same graph) and on the bucket size, never on data.
* Every reduce-scatter this object issued is completed by :meth:`GradReducer.drain` (called at the end of every
  backward); afterwards nothing is pending.
* The replicated (persistent) group is reduced at drain time, after all reduce-scatters: its (small) gradient is
  all-gathered and summed in rank order, as above.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridzero.comm.collectives import Comm, PendingCollective
from hybridzero.zero.groups import ShardedGroup
from hybridzero.zero.offload import move
from hybridzero.zero.ordered import ordered_sum
from hybridzero.zero.qgz import HierarchicalQuantizedReduce


@dataclass(frozen=True)
class ReductionScales:
    """Divisors of one gradient reduction: ``pre`` divides each rank's contribution before the exchange, ``post``
    divides the rank-ordered sum after it; ``None`` leaves the tensor untouched (no rounding at all)."""

    pre: float | None = None
    post: float | None = None


def reduction_scales(op: str, prescale: bool, predivide: float, world_size: int) -> ReductionScales:
    """DeepSpeed's scaling of a data-parallel gradient reduction (``DeepSpeedEngine.allreduce_bucket``), pure.

    * ``mean`` with ``prescale``: every contribution is divided by ``W`` before the sum.
    * ``mean`` otherwise: contributions divided by ``f = predivide`` (if ``f != 1``), the sum by ``W / f`` (if
      that is not 1). With the defaults that is one division of the sum by ``W``, bit for bit the old rule.
    * ``sum``: no scaling at all, whatever ``prescale`` and ``predivide`` say (DeepSpeed divides only when
      averaging: with ``sum`` both options are ignored).
    Invariant: ``(pre or 1) * (post or 1)`` is ``W`` for ``mean`` and 1 (both ``None``) for ``sum``.
    """
    if op not in ("mean", "sum"):
        raise ValueError(f"gradient_allreduce_op = {op!r} is invalid: expected 'mean' or 'sum'")
    if op == "sum":
        return ReductionScales()
    if prescale:
        return ReductionScales(pre=float(world_size))
    post = world_size / predivide
    return ReductionScales(pre=predivide if predivide != 1.0 else None, post=None if post == 1.0 else post)


def _scaled(total: torch.Tensor, divisor: float | None) -> torch.Tensor:
    """``total`` divided in place by ``divisor`` (untouched for None)."""
    return total if divisor is None else total.div_(divisor)


@dataclass
class _Piece:
    group: ShardedGroup
    cols: torch.Tensor  # [W, take] view of the group's flat gradient
    col_offset: int


class GradReducer:
    """Buckets group gradients and reduce-scatters them; owns every reduction it has in flight."""

    def __init__(
        self,
        comm: Comm,
        bucket_elems: int,
        overlap: bool,
        quantized: HierarchicalQuantizedReduce | None = None,
        scales: ReductionScales | None = None,
    ) -> None:
        self.comm = comm
        self.scales = ReductionScales(post=comm.world_size) if scales is None else scales  # default: mean
        self.world = comm.world_size
        self.cap_cols = max(1, bucket_elems // self.world)
        self.overlap = overlap
        self._pieces: list[_Piece] = []
        self._pending_cols = 0
        self._inflight: list[tuple[list[PendingCollective], list[Callable[[], None]]]] = []  # one item per flush
        self._replicated: list[tuple[ShardedGroup, torch.Tensor]] = []
        self.quantized = quantized  # qgZ: hierarchical quantized exchange instead of the flat one

    def submit(self, group: ShardedGroup, grad_full: torch.Tensor) -> None:
        """Queue one group's flat gradient (flushing full buckets). A group that fits in a bucket is never split
        over two (it starts a new bucket instead, DeepSpeed's rule for one gradient), so a bucket of whole groups
        needs no packing copy; bucket composition never changes a value (every element is summed in rank order)."""
        if group.replicated:
            self._replicated.append((group, grad_full))
            return
        grid = grad_full.view(self.world, group.layout.shard_numel)
        col, total = 0, group.layout.shard_numel
        if self.quantized is None and self._pending_cols and self._pending_cols + total > self.cap_cols:
            self.flush()  # qgZ keeps its packing: its quantization blocks follow the bucket's layout
        while col < total:
            take = min(total - col, self.cap_cols - self._pending_cols)
            self._pieces.append(_Piece(group, grid[:, col : col + take], col))
            self._pending_cols += take
            col += take
            if self._pending_cols >= self.cap_cols:
                self.flush()

    def flush(self) -> None:
        """Reduce the current bucket (asynchronously when overlapping). A piece that is a whole group's gradient
        (contiguous ``[W, S]``) is exchanged straight from the group's buffer, where autograd's gradients were put;
        only pieces of split groups are packed (one copy) into a shared exchange. Same bytes, same values; one
        collective per whole group instead of one per bucket."""
        if not self._pieces:
            return
        pieces, self._pieces, self._pending_cols = self._pieces, [], 0
        if self.quantized is not None:
            inp = self._pack(pieces)
            summed = self.quantized.reduce(inp, inp.numel() // self.world)
            self._distribute(pieces, _scaled(summed, self.scales.post))
            return
        split = [p for p in pieces if not p.cols.is_contiguous()]
        batches = [[p] for p in pieces if p.cols.is_contiguous()] + ([split] if split else [])
        started = [self._exchange(batch) for batch in batches]
        item = ([handle for handle, _ in started], [finish for _, finish in started])
        if self.overlap:
            self._inflight.append(item)
            if len(self._inflight) > 2:  # bound the memory held by reductions in flight
                self._complete(self._inflight.pop(0))
        else:
            self._complete(item)

    def _pack(self, pieces: list[_Piece]) -> torch.Tensor:
        """The pieces' columns as one rank-major flat tensor (a view when it is one contiguous piece), pre-scaled in
        place (the reducer owns the flat gradients it was handed)."""
        with self.comm.ledger.timer.region("copy.pack"):
            if len(pieces) == 1 and pieces[0].cols.is_contiguous():
                inp = pieces[0].cols.reshape(-1)
            else:
                inp = torch.cat([p.cols for p in pieces], dim=1).reshape(-1)
            return _scaled(inp, self.scales.pre)

    def _exchange(self, pieces: list[_Piece]) -> tuple[PendingCollective, Callable[[], None]]:
        """Issue the exchange of ``pieces``; returns its handle and the step that sums and distributes it."""
        inp = self._pack(pieces)
        recv = inp if self.world == 1 else torch.empty_like(inp)  # one rank: nothing to exchange, no copy
        handle = self.comm.exchange_for_reduce(recv, inp, phase="backward", async_op=self.overlap)
        timer, post = self.comm.ledger.timer, self.scales.post

        def finish() -> None:
            assert inp.numel() == recv.numel()  # holds ``inp`` alive until the collective completed
            with timer.region("comm.reduce_scatter.sum"):  # the reduction's own arithmetic, in rank order
                self._distribute(pieces, _scaled(ordered_sum(recv.view(self.world, -1)), post))

        return handle, finish

    @staticmethod
    def _distribute(pieces: list[_Piece], reduced: torch.Tensor) -> None:
        """Add each piece's reduced columns into its group's fp32 gradient shard."""
        start = 0
        for p in pieces:
            take = p.cols.shape[1]
            dst = p.group.grad_shard  # on the host with ZeRO-Offload: the reduced gradient goes there as it arrives
            dst[p.col_offset : p.col_offset + take].add_(move(reduced[start : start + take], dst.device))
            start += take

    @staticmethod
    def _complete(item: tuple[list[PendingCollective], list[Callable[[], None]]]) -> None:
        """Wait for one flush's exchanges and sum each, in issue order."""
        for handle, finish in zip(*item):
            handle.wait()
            finish()

    def drain(self) -> None:
        """Flush the partial bucket, complete every reduction in flight, then reduce replicated gradients."""
        self.flush()
        while self._inflight:
            self._complete(self._inflight.pop(0))
        for group, grad in self._replicated:
            recv = torch.empty(self.world * grad.numel(), dtype=grad.dtype, device=grad.device)
            self.comm.all_gather(recv, _scaled(grad, self.scales.pre), phase="backward", label="grad_all_gather")
            summed = _scaled(ordered_sum(recv.view(self.world, -1)), self.scales.post)
            group.grad_shard.add_(move(summed, group.grad_shard.device))
        self._replicated.clear()

    def abort(self) -> None:
        """Complete what is in flight (a collective must not be stranded), then forget everything queued."""
        while self._inflight:
            self._complete(self._inflight.pop(0))
        self._pieces, self._pending_cols = [], 0
        self._replicated.clear()

    def is_quiescent(self) -> bool:
        """Nothing queued, nothing in flight."""
        return not self._pieces and not self._inflight and not self._replicated

"""The shard store of a ``zero.Init`` context: each parameter it partitioned, one slice per rank.

A parameter is in one of two states, kept in the store's own :class:`_Entry` (nothing is written onto the tensor):

* **closed**: this rank holds ``shard`` = elements ``[r·S, (r+1)·S)`` of the parameter's row-major flat value padded
  to ``W·S`` (``S = padded_numel(numel, W) / W``); ``param.data`` is a size-0 placeholder of its dtype, DeepSpeed's
  ``[0]`` (a stray use outside the context fails on the shape); the whole shape is ``ds_shape``, kept here.
* **open**: ``param.data`` is the full value (a view of a freshly all-gathered padded buffer); writes land in it.

Invariants:

* Closing takes the parameter's current full value, broadcasts it from one rank (rank 0, or a ``GatheredParameters``
  modifier rank) and keeps this rank's slice, so every rank's slices come from one identical value even when ranks
  were seeded differently. With equal seeds the broadcast changes nothing (construction equals eager bit for bit).
* Open and close are collectives: every rank must run them in the same order. They are driven by the constructor's
  own sequence of torch calls, which every rank runs identically.
* At most ``max_open`` parameters (or those one torch call uses, if more) plus pinned ones are open: never the
  whole model.
* While ``busy`` the store is doing its own tensor work; the interception layer must not re-enter it.
* The store lives as long as any parameter it holds (a ``weakref.finalize`` per parameter references it, the
  registry only weakly), not as long as the ``with`` statement: ``with Init(): model = M()`` keeps its shards.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from hybridzero.comm.collectives import Comm
from hybridzero.zero.checksum import content_checksum
from hybridzero.zero.layout import padded_numel
from hybridzero.zero.param_view import DS_ATTRIBUTES, ZeroParamStatus

__all__ = ["InitStore", "placeholder"]


def _nothing(store: InitStore) -> None:
    """Finalizer of a partitioned parameter: holds its store until the parameter dies (see the invariants)."""
    del store


def placeholder(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A size-0 tensor of ``dtype`` on ``device``: a partitioned parameter's data, as in DeepSpeed (a stray use
    fails on the shape; the whole shape is the store's ``ds_shape``)."""
    return torch.empty(0, dtype=dtype, device=device)


@dataclass
class _Entry:
    """One partitioned parameter: metadata, this rank's slice and, while open, the full padded buffer."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device  # where the constructor made the parameter (and where it is whole while open)
    shard: torch.Tensor  # [S], on the store's shard device
    full: torch.Tensor | None = None  # [W·S] while open
    pins: int = 0  # open GatheredParameters blocks holding it open
    keepalive: weakref.finalize | None = None  # keeps the store alive exactly as long as the parameter

    @property
    def numel(self) -> int:
        return int(self.shape.numel())


class InitStore:
    """Per-parameter shards of one ``zero.Init`` context (see the module docstring)."""

    def __init__(
        self,
        comm: Comm,
        comm_device: torch.device,
        shard_device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        pin_memory: bool = False,
    ) -> None:
        self.comm = comm
        self.comm_device = comm_device  # where collectives run (CUDA under NCCL)
        self.shard_device = shard_device  # None: keep each slice where its parameter was built
        self.dtype = dtype
        self.pin_memory = pin_memory
        self.busy = False
        self.active = False  # True while the owning context is entered (the engine refuses to build then)
        # set by the owning zero.Init: suspends it for a block (initialize called inside the block that built the model)
        self.pause: Callable[[], AbstractContextManager[None]] | None = None
        self._entries: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._open: dict[int, nn.Parameter] = {}  # id -> param, in opening order (the same on every rank)

    # --- queries ----------------------------------------------------------------------------------------------
    def owns(self, param: torch.Tensor) -> bool:
        """True if ``param`` was partitioned by this store (and not released)."""
        return param in self._entries

    def shard_of(self, param: nn.Parameter) -> torch.Tensor:
        """This rank's slice of ``param`` (padded flat coordinates)."""
        return self._entries[param].shard

    def open_params(self) -> list[nn.Parameter]:
        """Parameters currently whole on this rank."""
        return list(self._open.values())

    def held_bytes(self) -> int:
        """Bytes of every slice and open buffer this store holds on this rank."""
        total = 0
        for entry in self._entries.values():
            total += entry.shard.numel() * entry.shard.element_size()
            if entry.full is not None:
                total += entry.full.numel() * entry.full.element_size()
        return total

    # --- state changes (collectives: every rank calls them in the same order) --------------------------------
    def partition(self, param: nn.Parameter) -> None:
        """Take ownership of a whole, freshly built ``param``: keep this rank's slice, leave a placeholder."""
        with self._working():
            data = param.data if self.dtype is None or not param.is_floating_point() else param.data.to(self.dtype)
            entry = _Entry(torch.Size(data.shape), data.dtype, data.device, torch.empty(0, dtype=data.dtype))
            entry.keepalive = weakref.finalize(param, _nothing, self)
            self._entries[param] = entry
            self._commit(param, entry, data, src=0)

    def open(self, param: nn.Parameter) -> None:
        """Make ``param`` whole: all-gather its slices (no-op if already open)."""
        entry = self._entries[param]
        if entry.full is not None:
            return
        with self._working():
            full = self._gather(entry)
            entry.full = full
            param.data = full[: entry.numel].view(entry.shape)
            self._open[id(param)] = param

    def close(self, param: nn.Parameter, src: int | None = 0) -> None:
        """Re-partition an open ``param`` from its current value broadcast from ``src``; ``src=None`` discards what
        was written while open (the slices are kept as they were)."""
        entry = self._entries[param]
        if entry.full is None:
            return
        with self._working():
            data = param.data
            del self._open[id(param)]
            entry.full = None
            if src is None:
                param.data = placeholder(entry.dtype, entry.device)
            else:
                self._commit(param, entry, data, src)

    def close_all(self, keep: Iterable[int] = (), src: int | None = 0) -> None:
        """Close every open, unpinned parameter whose id is not in ``keep`` (in opening order)."""
        keep_ids = set(keep)
        for pid, param in list(self._open.items()):
            if pid not in keep_ids and self._entries[param].pins == 0:
                self.close(param, src)

    def use(self, params: Iterable[nn.Parameter], max_open: int) -> None:
        """Make ``params`` whole and most recently used; then close the least recently used others until at most
        ``max_open`` unpinned parameters are whole (so aliases such as ``p.data`` of the last few stay valid)."""
        wanted = {id(p): p for p in params}
        for pid, p in wanted.items():
            if pid in self._open:
                self._open[pid] = self._open.pop(pid)  # most recently used last
            else:
                self.open(p)
        unpinned = [(pid, p) for pid, p in self._open.items() if self._entries[p].pins == 0]
        for pid, p in unpinned[: max(0, len(unpinned) - max(max_open, len(wanted)))]:
            if pid not in wanted:
                self.close(p)

    def release(self, params: Iterable[nn.Parameter]) -> None:
        """Forget ``params`` (their shards now live elsewhere, e.g. in the engine's groups)."""
        for p in params:
            if p in self._entries:
                self._open.pop(id(p), None)
                keepalive = self._entries.pop(p).keepalive
                if keepalive is not None:
                    keepalive.detach()

    def full_value(self, param: nn.Parameter) -> torch.Tensor:
        """The full value of ``param`` as a new tensor (a collective), leaving it closed."""
        entry = self._entries[param]
        with self._working():
            full = self._gather(entry)
        return full[: entry.numel].view(entry.shape)

    # --- DsOwner (hybridzero.zero.param_view): DeepSpeed's ds_* attributes ---------------------------------------
    def ds_attribute(self, param: nn.Parameter, name: str) -> Any:
        """``ds_id`` (construction order in this store), ``ds_shape``, ``ds_tensor`` (a copy of this rank's padded
        slice), ``ds_status`` (``AVAILABLE`` while open), ``ds_persist`` (False: persistence is an engine's choice)."""
        entry = self._entries.get(param)
        if entry is None or name not in DS_ATTRIBUTES:
            raise AttributeError(f"{name}: not a parameter this zero.Init context partitions")
        if name == "ds_id":
            return next(i for i, p in enumerate(self._entries.keys()) if p is param)
        if name in ("ds_shape", "ds_numel"):
            return entry.shape
        if name == "ds_persist":
            return False
        if name == "ds_status":
            return ZeroParamStatus.NOT_AVAILABLE if entry.full is None else ZeroParamStatus.AVAILABLE
        return entry.shard.clone()

    # --- ParamOwner (hybridzero.zero.registry) ----------------------------------------------------------------
    @contextmanager
    def gathered(self, params: list[nn.Parameter], modifier_rank: int | None) -> Iterator[None]:
        """Full ``params`` inside the block; on exit the value of ``modifier_rank`` is re-partitioned. Without a
        modifier, edits are discarded on every rank and, when any rank made one, every rank raises the same
        ``RuntimeError`` (agreed with one all-reduce; DeepSpeed's contract at ZeRO-3). Pending writes of other open
        parameters are committed first."""
        mine = [p for p in params if self.owns(p)]
        if modifier_rank is not None and not 0 <= modifier_rank < self.comm.world_size:
            raise ValueError(f"modifier_rank={modifier_rank} is not a rank of a world of size {self.comm.world_size}")
        self.close_all()
        for p in mine:
            self.open(p)
            self._entries[p].pins += 1
        # an in-place op bumps the tensor's version even when it leaves the values alone (``add_(0.0)``), as
        # DeepSpeed's check sees it; the checksum catches writes that bypass the version (``p.data[...] = ...``)
        before = [(p._version, content_checksum(p.data)) for p in mine] if modifier_rank is None else []
        failed = True
        try:
            yield
            failed = False
        finally:
            edited = any(
                p._version != v or not torch.equal(content_checksum(p.data), c) for p, (v, c) in zip(mine, before)
            )
            for p in mine:
                self._entries[p].pins -= 1
                if self._entries[p].pins == 0:
                    self.close(p, modifier_rank)
        if before and not failed:
            self._raise_if_edited(edited)

    def _raise_if_edited(self, edited: bool) -> None:
        """Agree (one all-reduce) on whether any rank edited inside a block without a modifier; raise on all."""
        flags = torch.zeros(self.comm.world_size, dtype=torch.float32, device=self.comm_device)
        flags[self.comm.rank] = float(edited)
        self.comm.all_reduce(flags, phase="zero_init")
        editors = [r for r in range(self.comm.world_size) if flags[r] > 0]
        if editors:
            raise RuntimeError(
                f"GatheredParameters: in-place modification of parameters inside the block on rank(s) {editors} "
                f"without a modifier_rank; the edit was discarded on every rank. Pass modifier_rank=<the rank "
                f"whose values to keep> (its values are broadcast to every rank)."
            )

    # --- internals ----------------------------------------------------------------------------------------------
    @contextmanager
    def _working(self) -> Iterator[None]:
        was, self.busy = self.busy, True
        try:
            yield
        finally:
            self.busy = was

    def _gather(self, entry: _Entry) -> torch.Tensor:
        """All-gather ``entry``'s slices into a new padded flat buffer on the parameter's device."""
        full = torch.empty(entry.shard.numel() * self.comm.world_size, dtype=entry.dtype, device=self.comm_device)
        self.comm.all_gather(full, entry.shard.to(self.comm_device), phase="zero_init")
        return full.to(entry.device)

    def _commit(self, param: nn.Parameter, entry: _Entry, data: torch.Tensor, src: int) -> None:
        """Broadcast ``data`` (the full value) from ``src``, keep this rank's slice, install the placeholder."""
        w, r = self.comm.world_size, self.comm.rank
        numel = int(data.numel())
        size = padded_numel(numel, w)
        flat = torch.zeros(size, dtype=data.dtype, device=self.comm_device)
        flat[:numel].copy_(data.reshape(-1))
        if w > 1:
            self.comm.broadcast(flat, src, phase="zero_init")
        shard = flat[r * (size // w) : (r + 1) * (size // w)].to(self.shard_device or data.device, copy=True)
        if self.pin_memory and torch.cuda.is_available() and shard.device.type == "cpu":
            shard = shard.pin_memory()
        entry.shape, entry.dtype, entry.device, entry.shard = torch.Size(data.shape), data.dtype, data.device, shard
        param.data = placeholder(entry.dtype, entry.device)

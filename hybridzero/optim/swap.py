"""ZeRO-Infinity for the optimizer: state tensors live in files between steps, streamed a chunk at a time.

``offload_optimizer: {device: nvme, nvme_path, buffer_count}`` with ``sub_group_size``: the optimizer's leaves
(views of the master, cut to at most ``sub_group_size`` elements by :func:`hybridzero.optim.sharded.split_views`)
are grouped into chunks of whole leaves of at most ``sub_group_size`` elements. A step walks the chunks: read the
chunk's state (``exp_avg``, ``exp_avg_sq``... every state tensor with a dimension) from the swap file, together with
the chunk's fp32 master elements when the master is in ``master.bin`` (:mod:`hybridzero.optim.swap_master`; the
engine's swapper always does that for sharded groups), step the optimizer on the chunk's leaves only, update the
groups' compute shards from the new master elements, write master and state back. Reads of the next chunks and
writes of the previous ones run on background threads (plain ``os.preadv``/``os.pwritev``, no compiled extension),
at most ``buffer_count`` chunks in memory at once. The gradient shards stay on the host (the reduction writes into
them).

Invariants:
* Between steps an offloaded leaf has no entry in ``optimizer.state``; its state tensors are in the file and its
  scalars (Adam's ``step``) in :attr:`StateSwapper.scalars`. :meth:`StateSwapper.resident` brings everything back
  (masters included, the leaves viewing them) for code that reads ``optimizer.state`` (checkpoint save/load) and
  swaps it out again after, so a checkpoint never depends on the swap files.
* The step is bitwise the step without offload: element-wise optimizers update each leaf from its own state only,
  and a leaf is stepped exactly once per step with the same hyperparameters.
* Each (leaf, key) owns one fixed byte region of the file, allocated at its first swap-out; the file is reserved
  at start-up for the estimated total (:func:`state_tensors_per_element`), so a step never meets a full disk.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hybridzero.config.models import ZeroConfig
from hybridzero.optim.swap_master import MasterSwap, ParamFiles, master_bytes, param_bytes
from hybridzero.optim.swapdir import SwapDir, check_space
from hybridzero.zero.groups import ShardedGroup

__all__ = ["StateSwapper", "build_swapper", "chunk_leaves", "state_tensors_per_element"]

STATE_FILE = "optimizer_state.bin"


@dataclass(frozen=True)
class Region:
    """One state tensor's place in the swap file."""

    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * torch.empty((), dtype=self.dtype).element_size()


def chunk_leaves(leaves: Sequence[nn.Parameter], sub_group_size: int) -> list[list[nn.Parameter]]:
    """Consecutive whole leaves, at most ``sub_group_size`` elements per chunk (a larger leaf alone). Pure."""
    chunks: list[list[nn.Parameter]] = []
    size = 0
    for leaf in leaves:
        if chunks and size + leaf.numel() <= sub_group_size:
            chunks[-1].append(leaf)
            size += leaf.numel()
        else:
            chunks.append([leaf])
            size = leaf.numel()
    return chunks


def state_tensors_per_element(optimizer: torch.optim.Optimizer) -> int:
    """How many fp32 state tensors the optimizer keeps per parameter element (2 for Adam), found by stepping a
    one-element probe built like ``optimizer``'s first param group; 2 if the class cannot be probed that way."""
    hparams = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"} if optimizer.param_groups else {}
    probe = nn.Parameter(torch.zeros(1))
    try:
        clone = type(optimizer)([probe], **hparams)
        probe.grad = torch.ones(1)
        clone.step()
    except Exception:  # noqa: BLE001 -- a client optimizer with another constructor: assume Adam's two
        return 2
    return sum(1 for t in clone.state[probe].values() if isinstance(t, torch.Tensor) and t.dim() > 0)


@contextlib.contextmanager
def _only(optimizer: torch.optim.Optimizer, chunk: Sequence[nn.Parameter]) -> Iterator[None]:
    """Restrict every param group to the leaves of ``chunk`` for one ``step()`` (restored after, even on error)."""
    ids = {id(p) for p in chunk}
    saved = [group["params"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) in ids]
    try:
        yield
    finally:
        for group, params in zip(optimizer.param_groups, saved):
            group["params"] = params


class StateSwapper:
    """The optimizer's state tensors in one swap file of a private :class:`SwapDir`, streamed chunk by chunk; with
    ``groups`` and ``leaves`` (the engine's (leaf, grad view) pairs) the sharded groups' fp32 masters too
    (:class:`~hybridzero.optim.swap_master.MasterSwap`), and with ``params`` their compute shards."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        nvme_path: str,
        rank: int,
        sub_group_size: int,
        buffer_count: int,
        *,
        groups: Sequence[ShardedGroup] = (),
        leaves: Sequence[tuple[nn.Parameter, torch.Tensor]] = (),
        params: ParamFiles | None = None,
    ) -> None:
        self.optimizer = optimizer
        opt_leaves = [p for group in optimizer.param_groups for p in group["params"]]
        self.chunks = chunk_leaves(opt_leaves, sub_group_size)
        self.buffer_count = max(1, buffer_count)
        self.reserved = 4 * state_tensors_per_element(optimizer) * sum(p.numel() for p in opt_leaves)
        self.dir = SwapDir(nvme_path, rank)
        self._io = ThreadPoolExecutor(max_workers=2, thread_name_prefix="hybridzero-swap")
        separate = params is not None and params.nvme_path != nvme_path
        param_dir = SwapDir(params.nvme_path, rank, "offload_param") if params and separate else None
        shards = param_bytes(groups) if params else 0
        try:
            needed = self.reserved + master_bytes(groups) + (0 if separate else shards)
            check_space(self.dir, needed, "optimizer state, fp32 masters and compute shards")
            if param_dir is not None:
                check_space(param_dir, shards, "compute shards")
            self.fd = self.dir.open_file(STATE_FILE, self.reserved)
            self.masters = MasterSwap(self.dir, groups, leaves, self._io, params, param_dir) if groups else None
        except BaseException:
            self.close()
            if param_dir is not None:
                param_dir.close()
            raise
        self.param_dir = param_dir
        self._grads = {id(leaf): grad for leaf, grad in leaves}  # bound chunk by chunk in step()
        self.regions: dict[int, dict[str, Region]] = {}  # id(leaf) -> key -> region (set once, at first swap-out)
        self.scalars: dict[int, dict[str, Any]] = {}  # id(leaf) -> state entries kept in memory
        self._end = 0
        self._count = threading.Lock()
        self._depth = 0  # nesting of resident() blocks
        self.bytes_read = 0
        self.bytes_written = 0

    # --- one leaf ------------------------------------------------------------------------------------------------
    def _region(self, leaf: nn.Parameter, key: str, t: torch.Tensor) -> Region:
        mine = self.regions.setdefault(id(leaf), {})
        region = mine.get(key)
        if region is None:
            region = Region(self._end, tuple(t.shape), t.dtype)
            mine[key] = region
            self._end += region.nbytes
        return region

    def _write(self, pairs: list[tuple[Region, torch.Tensor]]) -> None:
        for region, t in pairs:
            view = t.detach().contiguous().numpy().data.cast("B")
            done = os.pwritev(self.fd, [view], region.offset)
            if done != region.nbytes:
                raise OSError(f"short write to {self.dir.path / STATE_FILE}: {done} of {region.nbytes} bytes")
            with self._count:
                self.bytes_written += done

    def _read(self, leaf: nn.Parameter) -> dict[str, Any]:
        state: dict[str, Any] = dict(self.scalars.get(id(leaf), {}))
        for key, region in list(self.regions.get(id(leaf), {}).items()):
            t = torch.empty(region.shape, dtype=region.dtype)
            done = os.preadv(self.fd, [t.numpy().data.cast("B")], region.offset)
            if done != region.nbytes:
                raise OSError(f"short read from {self.dir.path / STATE_FILE}: {done} of {region.nbytes} bytes")
            with self._count:
                self.bytes_read += done
            state[key] = t.to(leaf.device)
        return state

    def _take(self, leaf: nn.Parameter) -> list[tuple[Region, torch.Tensor]]:
        """Remove the leaf's state from the optimizer: scalars kept here, tensors returned with their regions."""
        state = self.optimizer.state.pop(leaf, None)
        if state is None:
            return []
        pairs = []
        self.scalars[id(leaf)] = {}
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                pairs.append((self._region(leaf, key, value), value.cpu()))
            else:
                self.scalars[id(leaf)][key] = value
        return pairs

    def _read_chunk(self, chunk: Sequence[nn.Parameter]) -> list[dict[str, Any]]:
        return [self._read(leaf) for leaf in chunk]

    def _read_step_chunk(self, chunk: Sequence[nn.Parameter]) -> list[tuple[dict[str, Any], torch.Tensor | None]]:
        """State and (file-backed) master elements of each leaf of ``chunk`` (I/O thread)."""
        masters = self.masters
        return [(self._read(leaf), masters.read(leaf) if masters else None) for leaf in chunk]

    def _install(self, chunk: Sequence[nn.Parameter], states: list[dict[str, Any]]) -> None:
        for leaf, state in zip(chunk, states):
            if state:
                self.optimizer.state[leaf] = state

    def _write_chunk(
        self, pairs: list[tuple[Region, torch.Tensor]], masters: list[tuple[int, int, torch.Tensor]]
    ) -> None:
        """Write-behind of one stepped chunk: its state, then its master elements (I/O thread)."""
        self._write(pairs)
        if self.masters is not None:
            self.masters.write(masters)

    # --- the step ------------------------------------------------------------------------------------------------
    def step(self) -> None:
        """One optimizer step, chunk by chunk: read ahead and write behind on the I/O threads."""
        if self._depth:
            raise RuntimeError("optimizer step inside optimizer_state_resident(): the state is not swapped out")
        reads: deque[Future[list[tuple[dict[str, Any], torch.Tensor | None]]]] = deque()
        writes: deque[Future[None]] = deque()
        ahead = max(1, self.buffer_count // 2)
        nxt = 0
        masters = self.masters
        for chunk in self.chunks:
            while nxt < len(self.chunks) and len(reads) < ahead:
                reads.append(self._io.submit(self._read_step_chunk, self.chunks[nxt]))
                nxt += 1
            got = reads.popleft().result()
            self._install(chunk, [state for state, _ in got])
            for leaf, (_, values) in zip(chunk, got):
                if masters is not None and masters.home(leaf) is not None:
                    masters.install(leaf, values)  # a file-backed leaf gets its elements (and its gradient)
                elif id(leaf) in self._grads:
                    leaf.grad = self._grads[id(leaf)]
            with _only(self.optimizer, chunk):
                self.optimizer.step()
            pairs = [pair for leaf in chunk for pair in self._take(leaf)]
            back = [w for leaf in chunk if masters is not None and (w := masters.put_back(leaf)) is not None]
            writes.append(self._io.submit(self._write_chunk, pairs, back))
            while len(writes) > max(1, self.buffer_count - ahead):
                writes.popleft().result()
        for pending in writes:
            pending.result()

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """Every leaf's state in ``optimizer.state`` inside the block (checkpoint save/load); swapped out after.
        Reentrant: only the outermost block moves state."""
        self._depth += 1
        with contextlib.ExitStack() as stack:
            try:
                if self._depth == 1:
                    if self.masters is not None:
                        stack.enter_context(self.masters.resident())
                    for chunk in self.chunks:
                        self._install(chunk, self._read_chunk(chunk))
                yield
            finally:
                self._depth -= 1
                if self._depth == 0:
                    for chunk in self.chunks:
                        for leaf in chunk:
                            self._write(self._take(leaf))

    def file_bytes(self) -> int:
        """Bytes of optimizer state held in the swap file (allocated regions)."""
        return self._end

    @property
    def bytes_moved(self) -> tuple[int, int]:
        """Bytes read and written through every swap file (state, masters, compute shards) so far."""
        read, written = self.masters.io_bytes() if self.masters is not None else (0, 0)
        return self.bytes_read + read, self.bytes_written + written

    def close(self) -> None:
        """Stop the I/O threads and remove the swap directories (idempotent)."""
        self._io.shutdown(wait=True)
        self.dir.close()
        param_dir: SwapDir | None = getattr(self, "param_dir", None)  # unset when construction failed early
        if param_dir is not None:
            param_dir.close()


def build_swapper(
    zero: ZeroConfig,
    optimizer: torch.optim.Optimizer | None,
    rank: int,
    groups: Sequence[ShardedGroup],
    leaves: Sequence[Sequence[tuple[nn.Parameter, torch.Tensor]]],
) -> StateSwapper | None:
    """The swapper ``offload_optimizer: {device: nvme}`` asks for: optimizer state and the sharded groups' fp32
    masters in files (with ``offload_param: {device: nvme}`` their compute shards too, under its ``nvme_path``, or
    the optimizer's when it names none); None otherwise or without an optimizer (masters then stay on the host)."""
    opt, par = zero.offload_optimizer, zero.offload_param
    if opt.device != "nvme" or optimizer is None:
        return None
    params = None
    if par.device == "nvme":
        params = ParamFiles(str(par.nvme_path or opt.nvme_path), par.buffer_count, par.max_in_cpu)
    pairs = [pair for group in leaves for pair in group]
    return StateSwapper(
        optimizer,
        str(opt.nvme_path),
        rank,
        zero.sub_group_size,
        opt.buffer_count,
        groups=groups,
        leaves=pairs,
        params=params,
    )

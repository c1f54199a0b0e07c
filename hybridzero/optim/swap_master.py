"""ZeRO-Infinity's other half: the fp32 master shards (and, with ``offload_param: nvme``, the compute shards) in files.

With ``offload_optimizer: {device: nvme}`` every sharded group's master goes into ``master.bin`` of the run's swap
directory (:meth:`hybridzero.zero.groups.ShardedGroup.offload_to_files`); the group keeps only its compute-dtype
shard (on the device, on the host with ``offload_param: cpu``, or in ``params.bin`` with ``offload_param: nvme``).
The optimizer's leaves that viewed such a master become empty placeholders. A streamed step
(:class:`hybridzero.optim.swap.StateSwapper`) reads each chunk's master elements together with its state, points the
leaves at them, steps, writes both back and updates the compute shard from the new master values.

Invariants:
* Outside a step and outside :meth:`MasterSwap.resident` a file-backed leaf is an empty placeholder with no
  ``.grad``: a stray use fails loudly; inside a step it views the chunk's buffer with ``.grad`` bound to its
  gradient-shard view; inside :meth:`resident` it views the resident master (so code that finds leaves by storage,
  checkpoints and the fragment API, sees the usual picture).
* Persistent (whole) groups keep their small master in memory: they are never in a file.
* The bytes of every file are checked against free space and reserved at start-up (:func:`reserve_bytes`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from hybridzero.optim.swapdir import SwapDir
from hybridzero.optim.swapfile import ReadAhead, TensorFile
from hybridzero.zero.groups import ShardedGroup

__all__ = ["MASTER_FILE", "PARAM_FILE", "MasterSwap", "ParamFiles", "file_groups", "master_bytes", "param_bytes"]

MASTER_FILE = "master.bin"
PARAM_FILE = "params.bin"


@dataclass(frozen=True)
class ParamFiles:
    """``offload_param: {device: nvme, nvme_path, buffer_count, max_in_cpu}``: compute shards in files too."""

    nvme_path: str
    buffer_count: int
    max_in_cpu: int


@dataclass(frozen=True)
class LeafHome:
    """Where a file-backed optimizer leaf's elements live: ``[lo, lo + numel)`` of ``group``'s master."""

    group: ShardedGroup
    lo: int
    numel: int
    grad: torch.Tensor  # the leaf's view of the gradient shard


def file_groups(groups: Sequence[ShardedGroup]) -> list[ShardedGroup]:
    """The groups whose master goes to a file: every sharded one (whole masters stay in memory)."""
    return [g for g in groups if not g.master_is_whole]


def master_bytes(groups: Sequence[ShardedGroup]) -> int:
    """Bytes ``master.bin`` needs: 4 per element of each file-backed group's shard."""
    return 4 * sum(g.layout.shard_numel for g in file_groups(groups))


def param_bytes(groups: Sequence[ShardedGroup]) -> int:
    """Bytes ``params.bin`` needs: the compute dtype's size per element of each file-backed group's shard."""
    return sum(
        g.layout.shard_numel * torch.empty((), dtype=g.compute_dtype).element_size() for g in file_groups(groups)
    )


def _homes(groups: Sequence[ShardedGroup], leaves: Sequence[tuple[nn.Parameter, torch.Tensor]]) -> dict[int, LeafHome]:
    """Every leaf that views a file-bound master, by ``id(leaf)`` (found by storage sharing, before the move)."""
    by_storage = {g.master.untyped_storage().data_ptr(): g for g in groups if g.master.numel() > 0}
    homes: dict[int, LeafHome] = {}
    for leaf, grad in leaves:
        g = by_storage.get(leaf.untyped_storage().data_ptr())
        if g is not None:
            homes[id(leaf)] = LeafHome(g, int(leaf.storage_offset() - g.master.storage_offset()), leaf.numel(), grad)
    return homes


class MasterSwap:
    """The masters (and compute shards) of ``groups`` moved into files of ``swap_dir`` (see module docstring)."""

    def __init__(
        self,
        swap_dir: SwapDir,
        groups: Sequence[ShardedGroup],
        leaves: Sequence[tuple[nn.Parameter, torch.Tensor]],
        io: ThreadPoolExecutor,
        params: ParamFiles | None = None,
        param_dir: SwapDir | None = None,
    ) -> None:
        self.groups = file_groups(groups)
        self.homes = _homes(self.groups, leaves)
        self.leaves = {id(leaf): leaf for leaf, _ in leaves if id(leaf) in self.homes}
        self.master_file = TensorFile(swap_dir, MASTER_FILE, torch.float32, master_bytes(self.groups), io)
        self.param_file: TensorFile | None = None
        reader: ReadAhead | None = None
        if params is not None:
            dtype = self.groups[0].compute_dtype if self.groups else torch.float32
            pin = any(g.placement.pin_memory for g in self.groups)
            target = param_dir or swap_dir
            self.param_file = TensorFile(target, PARAM_FILE, dtype, param_bytes(self.groups), io, pin)
            reader = ReadAhead(self.param_file, params.buffer_count, params.max_in_cpu)
        for g in self.groups:
            g.offload_to_files(self.master_file, reader)
        for leaf in self.leaves.values():
            _park(leaf)

    def home(self, leaf: nn.Parameter) -> LeafHome | None:
        """Where ``leaf`` lives, if it is file-backed."""
        return self.homes.get(id(leaf))

    def read(self, leaf: nn.Parameter) -> torch.Tensor | None:
        """The leaf's master elements from the file (I/O thread), or None for a leaf that stays in memory."""
        home = self.homes.get(id(leaf))
        if home is None:
            return None
        return self.master_file.read(home.group.index, home.lo, home.lo + home.numel)

    def install(self, leaf: nn.Parameter, values: torch.Tensor | None) -> None:
        """Point a file-backed leaf at its elements read for the step, gradient bound."""
        home = self.homes.get(id(leaf))
        if home is not None and values is not None:
            leaf.data = values.to(home.group.host)
            leaf.grad = home.grad

    def put_back(self, leaf: nn.Parameter) -> tuple[int, int, torch.Tensor] | None:
        """After the step: update the group's compute shard from the leaf's new values, park the leaf, and return
        ``(key, lo, values)`` for the master file's write-behind (None for a leaf that stays in memory)."""
        home = self.homes.get(id(leaf))
        if home is None:
            return None
        values = leaf.detach()
        home.group.update_compute(home.lo, values)
        _park(leaf)
        return home.group.index, home.lo, values

    def write(self, writes: Sequence[tuple[int, int, torch.Tensor]]) -> None:
        """Write stepped master elements back (I/O thread)."""
        for key, lo, values in writes:
            self.master_file.write(key, values, lo)

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """Every master in memory and every file-backed leaf viewing it, for the block; written back after."""
        with contextlib.ExitStack() as stack:
            for g in self.groups:
                stack.enter_context(g.master_resident())
            for key, leaf in self.leaves.items():
                home = self.homes[key]
                leaf.data = home.group.master[home.lo : home.lo + home.numel]
            try:
                yield
            finally:
                for leaf in self.leaves.values():
                    _park(leaf)

    def file_bytes(self) -> tuple[int, int]:
        """Bytes held in ``master.bin`` and ``params.bin``."""
        return self.master_file.file_bytes(), self.param_file.file_bytes() if self.param_file else 0

    def io_bytes(self) -> tuple[int, int]:
        """Bytes read and written through both files so far."""
        files = [f for f in (self.master_file, self.param_file) if f is not None]
        return sum(f.bytes_read for f in files), sum(f.bytes_written for f in files)


def _park(leaf: nn.Parameter) -> None:
    """A file-backed leaf between uses: no gradient, an empty placeholder of its dtype on its device."""
    leaf.grad = None
    leaf.data = torch.empty(0, dtype=leaf.dtype, device=leaf.device)

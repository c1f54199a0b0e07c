"""ZeRO-Infinity's half of a gather group: the fp32 master (and the compute shard) in files.

:class:`FileBackedMaster` is a base of :class:`hybridzero.zero.groups.ShardedGroup`, kept apart so the group's file
stays readable. After :meth:`FileBackedMaster.offload_to_files` the group's ``master`` is an empty placeholder and
its elements live in a :class:`~hybridzero.zero.offload.ShardFile` (``optim/swapfile.py`` implements it: zero never
imports optim); the group keeps a *compute shard* (``compute``, on the device or the host) or, with
``offload_param: nvme``, reads it from a second file at each gather.

Invariants:
* The kept compute shard always equals the master cast to the compute dtype: the streamed optimizer step updates it
  piecewise (:meth:`update_compute`), every other write to the master happens inside :meth:`master_resident` and
  calls ``write_shard``, which re-derives it (:meth:`refresh_compute`).
* With ``offload_param: cpu`` and the optimizer on the device (:meth:`keep_compute_on_host`) there is no file: the
  kept compute shard lives on the host and every ``write_shard`` re-derives it from the in-memory master.
* :meth:`master_resident` is reentrant; only the outermost block reads the file and writes it back.
* Whole masters (stage 0, persistent groups) never go to a file.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from hybridzero.zero.offload import Placement, ShardFile, move

__all__ = ["FileBackedMaster"]


class FileBackedMaster:
    """The master-in-file state and operations of a group (see module docstring)."""

    # provided by ShardedGroup
    index: int
    name: str
    master: torch.Tensor
    master_is_whole: bool
    placement: Placement
    host: torch.device
    device: torch.device
    compute_dtype: torch.dtype

    def init_files(self) -> None:
        """No files yet: the master is in memory."""
        self.master_file: ShardFile | None = None
        self.param_file: ShardFile | None = None
        self.compute: torch.Tensor | None = None  # the kept compute shard (master in a file, params not)
        self._master_depth = 0  # nesting of master_resident() blocks

    def kept_shard(self) -> torch.Tensor | None:
        """The compute shard on the device when the master is in a file (read from its own file with
        ``offload_param: nvme``, copied on the side stream from pinned memory when CUDA is present); else None."""
        if self.param_file is not None:
            shard = self.param_file.read(self.index)
            copies = self.placement.copies
            return copies.to_device(shard, self.compute_dtype) if copies else move(shard, self.device)
        if self.compute is not None:
            return move(self.compute, self.device)
        return None

    def keep_compute_on_host(self) -> None:
        """``offload_param: cpu`` with the optimizer on the device: keep this sharded group's compute-dtype shard on
        the host (a copy, re-derived from the master by every ``write_shard``) and gather from it, as the kept shard
        of a master in a file is; the fp32 master and the optimizer state stay on the device. Whole masters (stage
        0-2, persistent groups) are never gathered from a shard, so they keep none."""
        if self.master_is_whole or self.master_file is not None:
            return
        host = torch.device("cpu")
        compute = move(self.master, host, self.compute_dtype, self.placement.pin_memory)
        self.compute = compute.clone() if compute is self.master else compute

    def offload_to_files(self, master_file: ShardFile, param_file: ShardFile | None) -> None:
        """Move the fp32 master into ``master_file`` (and the compute shard into ``param_file`` when given); from
        here on ``master`` is an empty placeholder outside :meth:`master_resident`. Sharded groups only."""
        if self.master_is_whole or self.master_file is not None:
            raise ValueError(f"group {self.name!r}: only a sharded group's master goes to a file, once")
        compute = move(self.master, self.placement.shard_device, self.compute_dtype)
        if compute is self.master:
            compute = compute.clone()  # fp32 on the same device: the kept shard must not alias the master
        master_file.write(self.index, self.master)
        if param_file is not None:
            param_file.write(self.index, compute)
        else:
            self.compute = compute
        self.master_file, self.param_file = master_file, param_file
        self.master = torch.empty(0, dtype=torch.float32, device=self.host)

    @contextlib.contextmanager
    def master_resident(self) -> Iterator[torch.Tensor]:
        """``master`` read from its file for the block and written back after (reentrant; a no-op without a file).
        Writers inside still call :meth:`write_shard`, which then re-derives the compute shard from it."""
        if self.master_file is None or self._master_depth > 0:
            self._master_depth += 1
            try:
                yield self.master
            finally:
                self._master_depth -= 1
            return
        self.master = move(self.master_file.read(self.index), self.host, torch.float32, self.placement.pin_memory)
        self._master_depth = 1
        try:
            yield self.master
        finally:
            self._master_depth = 0
            self.master_file.write(self.index, self.master)
            self.master = torch.empty(0, dtype=torch.float32, device=self.host)

    def update_compute(self, lo: int, values: torch.Tensor) -> None:
        """The optimizer step streamed ``values`` (fp32 master elements ``[lo, lo + n)``) back to the file: bring
        the kept compute shard up to date for them. Followed by :meth:`write_shard` once the step is done."""
        if self.param_file is not None:
            self.param_file.write(self.index, values.to(self.compute_dtype), lo)
        elif self.compute is not None:
            self.compute[lo : lo + values.numel()].copy_(values)

    def refresh_compute(self) -> None:
        """Re-derive the kept compute shard from a resident master (inside :meth:`master_resident`; always for the
        host shard of :meth:`keep_compute_on_host`)."""
        if self.master_file is None:
            if self.compute is not None:
                self.compute.copy_(self.master)
            return
        if self._master_depth == 0:
            return
        if self.param_file is not None:
            self.param_file.write(self.index, self.master.to(self.compute_dtype))
        elif self.compute is not None:
            self.compute.copy_(self.master)

"""Where model states live: a ``device`` for compute and a ``host`` for offloaded state (ZeRO-Offload).

``Placement`` is one frozen object per engine. Without offload ``host == device``. With
``offload_optimizer: {device: cpu|nvme}`` the fp32 master shard, the fp32 gradient shard and the optimizer state
live on ``host`` (the CPU); with ``nvme`` the optimizer's state tensors and the fp32 master shards of sharded groups
live in files between steps (:mod:`hybridzero.optim.swap`), and the group keeps a compute-dtype shard instead -- on
the device, on the host (``offload_param: cpu``) or in a file too (``offload_param: nvme``). A group reaches its
files only through the :class:`ShardFile` protocol (implemented in :mod:`hybridzero.optim.swapfile`). On a CPU-only
machine host and device are the same device, so every copy below is a no-op and results are bitwise those of the run
without offload; the roles (which state is "host") stay explicit and are what
:func:`hybridzero.runtime.memory.memory_report` reports.

Invariant: every copy between device and host goes through :func:`move` (pinned staging for host-bound copies and
non-blocking transfers when CUDA is present and ``pin_memory`` is set; the identity when nothing changes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

__all__ = ["CopyStream", "Placement", "ShardFile", "move"]


class ShardFile(Protocol):
    """Flat tensors kept in a file, one region per key (a group's index); what a group needs of a swap file."""

    def read(self, key: int, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Elements ``[lo, hi)`` of ``key`` (default all) as a new CPU tensor."""
        ...

    def write(self, key: int, t: torch.Tensor, lo: int = 0) -> None:
        """Write ``t`` at element ``lo`` of ``key`` (the first write of a key is whole and allocates it)."""
        ...


class CopyStream:
    """Host-to-device copies of shards read from files on a side CUDA stream (overlapping compute); without CUDA
    (or for a tensor not in pinned memory) a plain :func:`move`. Untested on a GPU in CI (no GPU there)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def to_device(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``t`` on the device in ``dtype``; the current stream waits for the copy before using the result."""
        if self.stream is None or not t.is_pinned():
            return move(t, self.device, dtype)
        current = torch.cuda.current_stream(self.device)
        done = torch.cuda.Event()
        with torch.cuda.stream(self.stream):
            out = t.to(self.device, dtype, non_blocking=True)  # the pinned source stays alive until copied
            done.record(self.stream)
        current.wait_event(done)
        out.record_stream(current)  # allocated on the side stream, used on the current one
        return out


@dataclass(frozen=True)
class Placement:
    """The compute ``device``, the ``host`` of offloaded state, and how offloaded state is held.

    Invariants: ``host == device`` unless ``optimizer`` is ``"cpu"`` or ``"nvme"``; ``params`` (offload_param)
    ``"nvme"`` only with an ``"nvme"`` optimizer (the config refuses other combinations); ``params == "cpu"`` with the
    optimizer on the device keeps the ZeRO-3 compute shards on the CPU (:attr:`params_on_host_only`).
    """

    device: torch.device
    host: torch.device
    optimizer: str = "none"  # offload_optimizer.device: none | cpu | nvme
    params: str = "none"  # offload_param.device: none | cpu | nvme
    pin_memory: bool = False
    copies: CopyStream | None = field(default=None, compare=False)

    @classmethod
    def build(
        cls, device: torch.device, optimizer: str = "none", params: str = "none", pin_memory: bool = False
    ) -> Placement:
        """The placement for a compute device and the two offload blocks' devices."""
        host = torch.device("cpu") if optimizer != "none" else device
        pin = pin_memory and torch.cuda.is_available()
        return cls(device, host, optimizer, params, pin, CopyStream(device) if pin else None)

    @property
    def offloads_optimizer(self) -> bool:
        """Master, gradient shard and optimizer state live on the host (or in files)."""
        return self.optimizer != "none"

    @property
    def state_in_files(self) -> bool:
        """Optimizer state tensors (and the sharded groups' fp32 masters) are in files between steps."""
        return self.optimizer == "nvme"

    @property
    def params_on_host_only(self) -> bool:
        """``offload_param: cpu`` without an offloaded optimizer: compute shards on the CPU, master on the device."""
        return self.params == "cpu" and not self.offloads_optimizer

    @property
    def shard_device(self) -> torch.device:
        """Where a kept compute shard lives when the master is in a file: the host with ``offload_param``."""
        return self.host if self.params != "none" else self.device

    def where(self, category: str) -> str:
        """``"device"``, ``"host"`` or ``"file"``: where ``category`` of model states lives between steps
        (``compute_shards``: the compute-dtype shards kept when the master is in a file)."""
        if category == "gradients" and self.offloads_optimizer:
            return "host"
        if category in ("master_weights", "optimizer_state") and self.offloads_optimizer:
            return "file" if self.state_in_files else "host"
        if category == "compute_shards":
            return {"none": "device", "cpu": "host"}.get(self.params, "file")
        return "device"


def move(
    t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None, pin_memory: bool = False
) -> torch.Tensor:
    """``t`` on ``device`` (and in ``dtype``): ``t`` itself when it already is; a host-bound copy is pinned when
    ``pin_memory`` and CUDA is present; copies from pinned memory are non-blocking (ordered on the current stream)."""
    dtype = dtype or t.dtype
    if t.device == device and t.dtype == dtype:
        return t
    if device.type == "cpu" and pin_memory and t.device.type != "cpu":
        out = torch.empty(t.shape, dtype=dtype, device=device, pin_memory=True)
        out.copy_(t, non_blocking=True)
        return out
    return t.to(device=device, dtype=dtype, non_blocking=t.device.type == "cpu" and t.is_pinned())

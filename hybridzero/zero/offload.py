"""Where model states live: a ``device`` for compute and a ``host`` for offloaded state (ZeRO-Offload).

``Placement`` is one frozen object per engine. Without offload ``host == device``. With
``offload_optimizer: {device: cpu|nvme}`` the fp32 master shard, the fp32 gradient shard and the optimizer state
live on ``host`` (the CPU); with ``nvme`` the optimizer's state tensors are further swapped out to files between
steps (:mod:`hybridzero.optim.swap`). On a CPU-only machine host and device are the same device, so every copy
below is a no-op and results are bitwise those of the run without offload; the roles (which state is "host") stay
explicit and are what :func:`hybridzero.runtime.memory.memory_report` reports.

Invariant: every copy between device and host goes through :func:`move` (pinned staging for host-bound copies and
non-blocking transfers when CUDA is present and ``pin_memory`` is set; the identity when nothing changes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Placement", "move"]


@dataclass(frozen=True)
class Placement:
    """The compute ``device``, the ``host`` of offloaded state, and how offloaded state is held.

    Invariants: ``host == device`` unless ``optimizer`` is ``"cpu"`` or ``"nvme"``; ``params`` (offload_param) is
    only ``"cpu"`` together with an offloaded optimizer (the config refuses other combinations).
    """

    device: torch.device
    host: torch.device
    optimizer: str = "none"  # offload_optimizer.device: none | cpu | nvme
    params: str = "none"  # offload_param.device: none | cpu
    pin_memory: bool = False

    @classmethod
    def build(
        cls, device: torch.device, optimizer: str = "none", params: str = "none", pin_memory: bool = False
    ) -> Placement:
        """The placement for a compute device and the two offload blocks' devices."""
        host = torch.device("cpu") if optimizer != "none" else device
        return cls(device, host, optimizer, params, pin_memory and torch.cuda.is_available())

    @property
    def offloads_optimizer(self) -> bool:
        """Master, gradient shard and optimizer state live on the host (or in files)."""
        return self.optimizer != "none"

    @property
    def state_in_files(self) -> bool:
        """Optimizer state tensors are swapped out to files between steps."""
        return self.optimizer == "nvme"

    def where(self, category: str) -> str:
        """``"device"``, ``"host"`` or ``"file"``: where ``category`` of model states lives between steps."""
        if category in ("master_weights", "gradients") and self.offloads_optimizer:
            return "host"
        if category == "optimizer_state" and self.offloads_optimizer:
            return "file" if self.state_in_files else "host"
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

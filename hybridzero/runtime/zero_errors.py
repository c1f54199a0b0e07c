"""``ZeRORuntimeException`` (DeepSpeed's ``deepspeed.runtime.zero.utils`` name) and the check that raises it.

DeepSpeed raises it at ``initialize`` when ZeRO-Offload would step a client optimizer that is not its CPU Adam or CPU
Lion while ``zero_force_ds_cpu_optimizer`` is on. hybridzero's ``DeepSpeedCPUAdam`` is torch's Adam, so a client
optimizer costs nothing extra: the check acts only when the config sets ``zero_force_ds_cpu_optimizer: true`` explicitly
(DeepSpeed's default is true).
"""

from __future__ import annotations

from typing import Any

import torch

from hybridzero.ops.adam import DeepSpeedCPUAdam
from hybridzero.ops.lion import DeepSpeedCPULion

__all__ = ["ZeRORuntimeException", "check_forced_cpu_optimizer"]


class ZeRORuntimeException(Exception):
    """A ZeRO configuration DeepSpeed refuses at run time (DeepSpeed's class name)."""


def check_forced_cpu_optimizer(cfg: Any, client_optimizer: torch.optim.Optimizer | None) -> None:
    """Raise :class:`ZeRORuntimeException` when ``zero_force_ds_cpu_optimizer`` is explicitly true, the optimizer is
    offloaded and the client optimizer is neither ``DeepSpeedCPUAdam`` nor ``DeepSpeedCPULion`` (DeepSpeed's rule: its
    ``DeepSpeedCPUAdagrad`` is refused there too)."""
    if client_optimizer is None or cfg.zero_force_ds_cpu_optimizer is not True:
        return
    if cfg.zero.offload_optimizer.enabled and not isinstance(client_optimizer, (DeepSpeedCPUAdam, DeepSpeedCPULion)):
        raise ZeRORuntimeException(
            f"zero_force_ds_cpu_optimizer = true with zero_optimization.offload_optimizer.device = "
            f"{cfg.zero.offload_optimizer.device!r} and a client optimizer {type(client_optimizer).__name__}: pass "
            f"deepspeed.ops.adam.DeepSpeedCPUAdam or deepspeed.ops.lion.DeepSpeedCPULion, set an optimizer block in "
            f"the config, or set "
            f"zero_force_ds_cpu_optimizer to false"
        )

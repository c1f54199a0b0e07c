"""``deepspeed.runtime.zero.offload_config``: DeepSpeed's offload enums (values as the config spells them)."""

from __future__ import annotations

import enum

__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum"]


class OffloadDeviceEnum(str, enum.Enum):
    """``offload_optimizer.device`` / ``offload_param.device``."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, enum.Enum):
    """The model-state kinds DeepSpeed's ``engine.offload_states`` names."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"

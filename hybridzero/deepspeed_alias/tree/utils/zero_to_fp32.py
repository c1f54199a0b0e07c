"""``deepspeed.utils.zero_to_fp32``: consolidate a checkpoint of hybridzero's into one fp32 state dict
(:mod:`hybridzero.runtime.zero_to_fp32`)."""

from __future__ import annotations

from hybridzero.runtime.zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
]

"""``deepspeed.moe.utils``: ``split_params_into_different_moe_groups_for_optimizer`` (no DeepSpeed MoE layer exists
here, so there are no expert parameters to split: param groups come back as given) and ``is_moe_param``."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["is_moe_param", "split_params_into_different_moe_groups_for_optimizer"]


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether ``param`` belongs to a DeepSpeed MoE layer's experts: never here."""
    del param
    return False


def split_params_into_different_moe_groups_for_optimizer(param_groups: Any, max_group_size: int | None = None) -> Any:
    """DeepSpeed splits expert parameters into their own groups; without DeepSpeed MoE layers there are none, so
    the groups are returned as given (a dict becomes a one-element list, as DeepSpeed's)."""
    del max_group_size
    return [param_groups] if isinstance(param_groups, dict) else param_groups

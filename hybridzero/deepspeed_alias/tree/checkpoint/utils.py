"""``deepspeed.checkpoint.utils``: ``clone_tensors_for_torch_save`` (accelerate's ``get_state_dict`` at stages
0-2)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["clone_tensors_for_torch_save"]


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    """``item`` with every tensor replaced by a detached copy on ``device`` (lists, tuples and dicts rebuilt),
    so a saved tensor carries no view of a larger storage -- DeepSpeed's contract."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)((k, clone_tensors_for_torch_save(v, device)) for k, v in item.items())
    return item

"""``deepspeed.checkpoint.utils``: ``clone_tensors_for_torch_save`` (accelerate's ``get_state_dict`` at stages
0-2)."""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["clone_tensors_for_torch_save", "get_model_ckpt_name_for_rank"]


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


def get_model_ckpt_name_for_rank(base_folder: str, mp_rank_str: str) -> str:
    """DeepSpeed's model-states file name in a tag folder (``mp_rank_XX_model_states.pt``). hybridzero's own
    checkpoints are safetensors and JSON and hold no such file; DeepSpeed-written ones do."""
    return os.path.join(base_folder, f"mp_rank_{mp_rank_str}_model_states.pt")

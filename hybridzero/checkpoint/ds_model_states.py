"""DeepSpeed's ``mp_rank_00_model_states.pt`` beside hybridzero's own checkpoint files (ZeRO stages 0-2).

DeepSpeed users read a ZeRO-1/2 checkpoint's weights with ``torch.load(TAG/mp_rank_00_model_states.pt)["module"]``
(its own tests do, and so do scripts that pick weights out of a save directory). At stages 0-2 every rank holds the
whole parameters, so rank 0 writes that file too: the module's state (parameters and buffers as the model computes
with them, each tensor its own copy, frozen parameters left out with ``exclude_frozen_parameters``), DeepSpeed's
shape and name lists and the step counters. It holds tensors, lists, dicts and ``torch.Size`` only, so it loads with
``torch.load(..., weights_only=True)``. It is written, never read: hybridzero resumes from its own files (a save
directory is recognised as hybridzero's by its manifest, so this file does not make it look like DeepSpeed's). At
ZeRO-3 DeepSpeed's per-rank model-states files hold empty parameters; none is written here.

Cost: one 16-bit (or fp32) copy of the model per checkpoint, an eighth of Adam's fp32 master and moments in bf16.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hybridzero.checkpoint.format import DS_MODEL_STATES, sha256_file

__all__ = ["DS_MODEL_STATES", "write_ds_model_states"]


def _module_state(module: nn.Module, exclude_frozen: bool) -> OrderedDict[str, torch.Tensor]:
    frozen = {name for name, p in module.named_parameters() if not p.requires_grad} if exclude_frozen else set()
    return OrderedDict(
        (name, t.detach().cpu().clone()) for name, t in module.state_dict().items() if name not in frozen
    )


def write_ds_model_states(partial: Path, module: nn.Module, exclude_frozen: bool, counters: dict[str, int]) -> str:
    """Write :data:`DS_MODEL_STATES` into ``partial`` (the tag's directory being written); returns its sha256.

    ``counters``: ``global_steps``, ``global_samples``, ``skipped_steps``, ``dp_world_size`` (DeepSpeed's keys)."""
    params = list(module.named_parameters())
    state: dict[str, Any] = {
        "module": _module_state(module, exclude_frozen),
        "buffer_names": [name for name, _ in module.named_buffers()],
        "param_shapes": [OrderedDict((n, p.shape) for n, p in params if p.requires_grad)],
        "frozen_param_shapes": None
        if exclude_frozen
        else OrderedDict((n, p.shape) for n, p in params if not p.requires_grad),
        "shared_params": {},
        "lr_scheduler": None,
        "sparse_tensor_module_names": [],
        "global_steps": counters["global_steps"],
        "global_samples": counters["global_samples"],
        "skipped_steps": counters["skipped_steps"],
        "iteration": counters["global_steps"],
        "dp_world_size": counters["dp_world_size"],
        "mp_world_size": 1,
    }
    path = partial / DS_MODEL_STATES
    torch.save(state, path)
    return sha256_file(path)

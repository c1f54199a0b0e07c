"""``hybridzero.from_pretrained``: a Hugging Face checkpoint straight into shards.

The model skeleton is built on the meta device from the checkpoint's config (no weights anywhere), then every rank
reads only the elements its shards own from the safetensors files (single file or sharded with an index). No rank
ever holds the full model.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
import transformers
from torch import nn

from hybridzero.checkpoint.hf_source import HFCheckpointSource, check_against_model
from hybridzero.runtime.initialize import initialize
from hybridzero.zero.partition import param_aliases


def meta_model(path: str | os.PathLike[str], model_cls: Any = None, **config_overrides: Any) -> nn.Module:
    """The model of the HF directory ``path`` built on the meta device (``model_cls`` defaults to
    ``AutoModelForCausalLM``)."""
    hf_config = transformers.AutoConfig.from_pretrained(path, **config_overrides)
    cls = model_cls or transformers.AutoModelForCausalLM
    with torch.device("meta"):
        return cls.from_config(hf_config)


def check_model_matches(source: HFCheckpointSource, model: nn.Module) -> None:
    """Every parameter present with the model's shape, nothing unexpected (transformers' rules; headers only)."""
    shapes = dict(model.named_parameters())
    params = {first: (names, shapes[first].shape) for first, names in param_aliases(model).items()}
    buffers = [name for name, _ in model.named_buffers()]
    ignore = [str(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    check_against_model(source, params, buffers, ignore)


def from_pretrained(
    path: str | os.PathLike[str],
    config: Mapping[str, Any] | str | os.PathLike[str],
    *,
    model_cls: Any = None,
    config_overrides: Mapping[str, Any] | None = None,
    **initialize_kwargs: Any,
) -> tuple[Any, Any, Any, Any]:
    """``initialize`` on the checkpoint at ``path``: returns ``(engine, optimizer, dataloader, lr_scheduler)``."""
    model = meta_model(path, model_cls, **dict(config_overrides or {}))
    with HFCheckpointSource(path) as source:  # every shard is read during initialize; then the files close
        check_model_matches(source, model)
        return initialize(model=model, config=config, checkpoint_source=source, **initialize_kwargs)

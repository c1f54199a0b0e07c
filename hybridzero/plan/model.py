"""The model a plan is about: a Hugging Face config (a directory, a ``config.json`` or a known name) built on the
meta device, so a 70B model costs no memory and its parameters have exactly the engine's names and shapes.

Known names (``data/shapes.json``) are public configs of well-known checkpoints; no weights are ever read.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

from hybridzero.lora import convert_linear_layer_to_lora, only_optimize_lora

__all__ = ["LoRAPlan", "known_shapes", "load_hf_config", "meta_model"]


@cache
def _shapes() -> dict[str, dict[str, Any]]:
    text = resources.files("hybridzero.plan").joinpath("data/shapes.json").read_text(encoding="utf-8")
    return {k: v for k, v in json.loads(text).items() if not k.startswith("_")}


def known_shapes() -> list[str]:
    """Names accepted by ``--model`` besides paths."""
    return sorted(_shapes())


def load_hf_config(model: str) -> transformers.PretrainedConfig:
    """``model`` as a Hugging Face config: a known name, a ``config.json`` file or a directory holding one.

    Only JSON is read (never code or pickles); raises ValueError naming the argument and the known names."""
    shapes = _shapes()
    if model in shapes:
        fields = dict(shapes[model])
        return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(
            f"--model {model!r} is neither a known shape ({', '.join(sorted(shapes))}) nor a config.json / HF directory"
        )
    fields = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise ValueError(f"{path} is not a Hugging Face config: it has no 'model_type'")
    kind = fields.pop("model_type")
    return transformers.AutoConfig.for_model(kind, **fields)


class LoRAPlan:
    """DeepSpeed-Chat LoRA as the plan applies it: ``dim`` on every ``nn.Linear`` whose name contains ``part``."""

    def __init__(self, part: str, dim: int, only_lora: bool = True) -> None:
        if dim < 1:
            raise ValueError(f"LoRA dim must be >= 1, got {dim}")
        self.part, self.dim, self.only_lora = part, dim, only_lora


def meta_model(config: transformers.PretrainedConfig, lora: LoRAPlan | None = None, frozen: bool = False) -> nn.Module:
    """The causal LM of ``config`` on the meta device (fp32 parameters, as the engine's master); with ``lora``
    the adapters are added (and, with ``only_lora``, everything else frozen); ``frozen`` freezes everything
    (reference and reward models)."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if lora is not None:
        convert_linear_layer_to_lora(model, lora.part, lora.dim)
        if lora.only_lora:
            only_optimize_lora(model)
    if frozen:
        model.requires_grad_(False)
    return model

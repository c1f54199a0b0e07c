"""DeepSpeed-Chat's LoRA flags acting on the RLHF models (steps 1-3): one place that reads them.

* ``--lora_dim`` / ``--lora_module_name`` (steps 1-2), ``--actor_lora_dim`` / ``--actor_lora_module_name`` and
  ``--critic_lora_dim`` / ``--critic_lora_module_name`` (step 3): every ``nn.Linear`` whose qualified name contains
  the substring becomes a :class:`hybridzero.lora.LoRALinear` (DS-Chat's math, init and frozen base weight);
  ``lora_dim = 0`` leaves the model as it is.
* ``--only_optimize_lora``: every non-adapter parameter frozen (no gradient shard, no optimizer state), except
  step 2's value head (DS-Chat's ``force_optimize_params``; its step-3 critic freezes the head too).
* ``--lora_learning_rate`` / ``--actor_lora_learning_rate`` / ``--critic_lora_learning_rate``: the adapters' own
  optimizer group (DS-Chat's ``get_optimizer_grouped_parameters(..., lora_lr)``).
* ``--enable_mixed_precision_lora`` (actor): DS-Chat's meaning, ``zero_quantized_nontrainable_weights`` (the
  frozen base is gathered as int8 blocks); the hybrid engine's merged copy is in the compute dtype either way.

Models are saved merged (DS-Chat's ``convert_lora_to_linear_layer`` before ``save_hf_format``): the savers in
:mod:`hybridzero.rlhf.models` fold the adapters in, so step 2 and step 3 read plain HF directories.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from hybridzero.lora import (
    SourceWithExtra,
    convert_linear_layer_to_lora,
    initial_adapters,
    only_optimize_lora,
    split_lora_groups,
)

__all__ = ["LoRASpec", "apply_lora", "lora_source"]


@dataclass(frozen=True)
class LoRASpec:
    """One model's LoRA settings (``dim == 0``: off)."""

    dim: int = 0
    module_name: str = "decoder.layers."
    only_optimize: bool = False
    learning_rate: float = 5e-4
    seed: int = 0
    force_optimize: tuple[str, ...] = ()  # kept trainable under only_optimize (step 2: the value head, as DS-Chat)

    @property
    def enabled(self) -> bool:
        """True when adapters are added."""
        return self.dim > 0


def apply_lora(model: nn.Module, spec: LoRASpec, lr: float, weight_decay: float) -> list[dict[str, Any]] | None:
    """Convert ``model`` in place per ``spec``; returns the optimizer parameter groups to pass as
    ``model_parameters`` (``None`` when LoRA is off: the engine's default single group)."""
    if not spec.enabled:
        return None
    convert_linear_layer_to_lora(model, spec.module_name, spec.dim, seed=spec.seed)
    if spec.only_optimize:
        only_optimize_lora(model, spec.force_optimize)
    return split_lora_groups(model, weight_decay, lr, spec.learning_rate)


def lora_source(model: nn.Module, spec: LoRASpec, source: Any) -> Any:
    """A checkpoint source that also serves the fresh adapters of a meta-device ``model`` (same values every rank
    builds from ``spec.seed``); ``source`` itself when LoRA is off."""
    return SourceWithExtra(source, initial_adapters(model, spec.seed)) if spec.enabled else source

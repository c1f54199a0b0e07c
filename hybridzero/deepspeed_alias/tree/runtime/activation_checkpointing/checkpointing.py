"""``deepspeed.runtime.activation_checkpointing.checkpointing``, which ``deepspeed.checkpointing`` names (as in
DeepSpeed, an attribute of ``deepspeed``): DeepSpeed's activation-checkpointing API (``configure``, ``checkpoint``,
``non_reentrant_checkpoint``, the Megatron RNG tracker), served by
:mod:`hybridzero.runtime.activation_checkpointing`."""

from __future__ import annotations

from typing import Any

from hybridzero.deepspeed_alias.unprovided import missing_attribute
from hybridzero.runtime.activation_checkpointing import *  # noqa: F403
from hybridzero.runtime.activation_checkpointing import RNGStatesTracker
from hybridzero.runtime.activation_checkpointing import __all__ as _served

CudaRNGStatesTracker = RNGStatesTracker  # DeepSpeed's class name

__all__ = [*_served, "CudaRNGStatesTracker"]


def __getattr__(name: str) -> Any:
    raise missing_attribute("deepspeed.runtime.activation_checkpointing.checkpointing", name)

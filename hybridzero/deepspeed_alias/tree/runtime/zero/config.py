"""``deepspeed.runtime.zero.config``: ``DeepSpeedZeroConfig`` is hybridzero's ``zero_optimization`` block model
(:class:`hybridzero.config.models.ZeroConfig`: DeepSpeed's keys and defaults, validated the same way), plus
DeepSpeed's deprecation warning through ``deepspeed.utils.logger`` when ``elastic_checkpoint`` is asked for at
stage 3 (the key is accepted and has no effect, as in DeepSpeed, whose ZeRO-3 never had elastic checkpoints)."""

from __future__ import annotations

from typing import Any

from hybridzero.config.models import ZeroConfig
from hybridzero.deepspeed_alias.tree import utils

__all__ = ["DeepSpeedZeroConfig"]

ELASTIC_ZERO3 = (
    "Elastic checkpointing is deprecated and has no effect at ZeRO stage 3 (a ZeRO-3 checkpoint loads at any world "
    "size); remove 'elastic_checkpoint' from zero_optimization"
)


class DeepSpeedZeroConfig(ZeroConfig):
    """:class:`ZeroConfig` as DeepSpeed's constructor takes it (keyword arguments under DeepSpeed's key names)."""

    def __init__(self, **data: Any) -> None:
        super().__init__(**data)
        if data.get("elastic_checkpoint") and self.stage == 3:
            utils.logger.warning(ELASTIC_ZERO3)

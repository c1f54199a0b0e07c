"""``deepspeed.runtime.zero.config``: ``DeepSpeedZeroConfig`` is hybridzero's ``zero_optimization`` block model
(:class:`hybridzero.config.models.ZeroConfig`: DeepSpeed's keys and defaults, validated the same way)."""

from __future__ import annotations

from hybridzero.config.models import ZeroConfig

__all__ = ["DeepSpeedZeroConfig"]

DeepSpeedZeroConfig = ZeroConfig

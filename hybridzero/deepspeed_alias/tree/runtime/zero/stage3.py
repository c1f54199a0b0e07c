"""``deepspeed.runtime.zero.stage3``: ``DeepSpeedZeroOptimizer_Stage3`` (import-only stand-in, as
``stage_1_and_2``'s)."""

from __future__ import annotations

from hybridzero.deepspeed_alias.unprovided import unprovided_class

__all__ = ["DeepSpeedZeroOptimizer_Stage3"]

DeepSpeedZeroOptimizer_Stage3 = unprovided_class(
    "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3", "DeepSpeed's internal ZeRO-3 optimizer wrapper"
)

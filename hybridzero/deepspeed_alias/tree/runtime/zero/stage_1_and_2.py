"""``deepspeed.runtime.zero.stage_1_and_2``: ``DeepSpeedZeroOptimizer`` (import-only stand-in for DeepSpeed's ZeRO
1/2 optimizer wrapper; hybridzero's ``engine.optimizer`` is its ``ZeroOptimizer``, the torch optimizer over the shards
answering this wrapper's attribute names)."""

from __future__ import annotations

from hybridzero.deepspeed_alias.unprovided import unprovided_class

__all__ = ["DeepSpeedZeroOptimizer"]

DeepSpeedZeroOptimizer = unprovided_class(
    "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer", "DeepSpeed's internal ZeRO optimizer wrapper"
)

"""``deepspeed.runtime.bf16_optimizer``: ``BF16_Optimizer`` names DeepSpeed's internal bf16 optimizer wrapper; an
import-only stand-in here (hybridzero's ``engine.optimizer`` is its ``ZeroOptimizer``: the torch optimizer over the fp32
shards, answering the ZeRO wrappers' attribute names)."""

from __future__ import annotations

from hybridzero.deepspeed_alias.unprovided import unprovided_class

__all__ = ["BF16_Optimizer"]

BF16_Optimizer = unprovided_class(
    "deepspeed.runtime.bf16_optimizer.BF16_Optimizer",
    "DeepSpeed's internal optimizer wrapper (engine.optimizer is hybridzero's ZeroOptimizer)",
)

"""``deepspeed.runtime.fp16.fused_optimizer``: ``FP16_Optimizer``, an import-only stand-in for DeepSpeed's internal
fp16 wrapper (hybridzero's ``engine.optimizer`` is its ``ZeroOptimizer`` over the torch optimizer; loss scaling lives in
the engine, read as ``engine.optimizer.loss_scale``)."""

from __future__ import annotations

from hybridzero.deepspeed_alias.unprovided import unprovided_class

__all__ = ["FP16_Optimizer"]

FP16_Optimizer = unprovided_class(
    "deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer", "DeepSpeed's internal optimizer wrapper"
)

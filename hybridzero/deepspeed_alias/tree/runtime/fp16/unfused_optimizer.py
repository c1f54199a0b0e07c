"""``deepspeed.runtime.fp16.unfused_optimizer``: ``FP16_UnfusedOptimizer`` (import-only stand-in, as
``fused_optimizer``'s)."""

from __future__ import annotations

from hybridzero.deepspeed_alias.unprovided import unprovided_class

__all__ = ["FP16_UnfusedOptimizer"]

FP16_UnfusedOptimizer = unprovided_class(
    "deepspeed.runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer", "DeepSpeed's internal optimizer wrapper"
)

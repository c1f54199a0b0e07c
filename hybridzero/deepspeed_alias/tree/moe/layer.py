"""``deepspeed.moe.layer``: ``MoE`` imports and refuses to be built (no expert parallelism)."""

from __future__ import annotations

from hybridzero.deepspeed_alias.unprovided import unprovided_class

__all__ = ["MoE"]

MoE = unprovided_class("deepspeed.moe.layer.MoE", "DeepSpeed's expert-parallel MoE layer (no expert parallelism)")

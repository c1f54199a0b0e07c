"""``deepspeed.runtime.hybrid_engine_graph``: DeepSpeed's CUDA-graph capture of the hybrid engine's decode is not
provided (hybridzero's ``engine.generate`` decodes eagerly); its names import and fail when called."""

from __future__ import annotations

from hybridzero.deepspeed_alias.unprovided import unprovided, unprovided_class

__all__ = ["DecodeGraphCache", "decode_steps_from_generate_kwargs", "validate_cuda_graph_support"]

_WHY = "CUDA-graph capture of the hybrid engine's decode (hybridzero's engine.generate decodes eagerly)"
DecodeGraphCache = unprovided_class("deepspeed.runtime.hybrid_engine_graph.DecodeGraphCache", _WHY)
_MOD = "deepspeed.runtime.hybrid_engine_graph"
decode_steps_from_generate_kwargs = unprovided(f"{_MOD}.decode_steps_from_generate_kwargs", _WHY)
validate_cuda_graph_support = unprovided(f"{_MOD}.validate_cuda_graph_support", _WHY)

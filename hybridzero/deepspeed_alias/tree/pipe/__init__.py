"""``deepspeed.pipe``: pipeline parallelism is not provided; ``PipelineModule``, ``LayerSpec`` and
``TiedLayerSpec`` import (so modules that define pipeline variants still load) and refuse to be built."""

from __future__ import annotations

from hybridzero.deepspeed_alias.unprovided import unprovided_class

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]

_WHY = "pipeline parallelism (hybridzero is data-parallel only: ZeRO)"
PipelineModule = unprovided_class("deepspeed.pipe.PipelineModule", _WHY)
LayerSpec = unprovided_class("deepspeed.pipe.LayerSpec", _WHY)
TiedLayerSpec = unprovided_class("deepspeed.pipe.TiedLayerSpec", _WHY)

"""``deepspeed.runtime.zero``: ``GatheredParameters``, ``Init`` (as ``deepspeed.zero``),
``unwrap_model_for_generation``, ``ZeroParamStatus``."""

from __future__ import annotations

from hybridzero.runtime.zero import unwrap_model_for_generation
from hybridzero.runtime.zero.partition_parameters import ZeroParamStatus
from hybridzero.zero import GatheredParameters, Init

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "unwrap_model_for_generation"]

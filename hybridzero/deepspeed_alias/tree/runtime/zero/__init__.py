"""``deepspeed.runtime.zero``: ``GatheredParameters``, ``Init`` (as ``deepspeed.zero``),
``unwrap_model_for_generation``."""

from __future__ import annotations

from hybridzero.runtime.zero import unwrap_model_for_generation
from hybridzero.zero import GatheredParameters, Init

__all__ = ["GatheredParameters", "Init", "unwrap_model_for_generation"]

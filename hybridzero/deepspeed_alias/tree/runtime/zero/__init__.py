"""``deepspeed.runtime.zero``: ``GatheredParameters``, ``Init`` (as ``deepspeed.zero``)."""

from __future__ import annotations

from hybridzero.zero import GatheredParameters, Init

__all__ = ["GatheredParameters", "Init"]

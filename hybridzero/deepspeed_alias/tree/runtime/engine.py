"""``deepspeed.runtime.engine``: ``DeepSpeedEngine`` is hybridzero's :class:`~hybridzero.runtime.engine.Engine`."""

from __future__ import annotations

from hybridzero.runtime.engine import Engine

__all__ = ["DeepSpeedEngine"]

DeepSpeedEngine = Engine

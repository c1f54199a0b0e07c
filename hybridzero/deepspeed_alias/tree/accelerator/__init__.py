"""``deepspeed.accelerator``: ``get_accelerator`` (:mod:`hybridzero.accelerator`)."""

from __future__ import annotations

from hybridzero.accelerator import get_accelerator

__all__ = ["get_accelerator"]

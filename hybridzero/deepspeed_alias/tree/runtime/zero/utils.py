"""``deepspeed.runtime.zero.utils``: ``ZeRORuntimeException`` (:mod:`hybridzero.runtime.zero_errors`)."""

from __future__ import annotations

from hybridzero.runtime.zero_errors import ZeRORuntimeException

__all__ = ["ZeRORuntimeException"]

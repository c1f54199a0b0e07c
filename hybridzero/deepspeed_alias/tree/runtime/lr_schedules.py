"""``deepspeed.runtime.lr_schedules``: ``VALID_LR_SCHEDULES``, the scheduler names a config's ``scheduler.type``
takes (accelerate hands a client scheduler of one of these class names to ``initialize``)."""

from __future__ import annotations

from hybridzero.optim.schedulers import SUPPORTED_SCHEDULERS

__all__ = ["VALID_LR_SCHEDULES"]

VALID_LR_SCHEDULES: list[str] = list(SUPPORTED_SCHEDULERS)

"""``deepspeed.compression.helper``: ``recursive_getattr`` / ``recursive_setattr``
(:mod:`hybridzero.compression.helper`; DeepSpeed-Chat's LoRA code imports them)."""

from __future__ import annotations

from hybridzero.compression.helper import *  # noqa: F403
from hybridzero.compression.helper import __all__ as __all__  # noqa: PLC0414

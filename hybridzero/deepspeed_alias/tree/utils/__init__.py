"""``deepspeed.utils``: the tensor-fragment API (``safe_get_full_*`` ...), DeepSpeed's ``logger``,
``is_initialized``; ``set_z3_leaf_modules`` fails naming itself."""

from __future__ import annotations

import logging
from typing import Any

from hybridzero.comm import is_initialized
from hybridzero.deepspeed_alias.unprovided import missing_attribute, unprovided
from hybridzero.utils import *  # noqa: F403  (safe_get_* / safe_set_*, as hybridzero.utils.__all__ lists them)
from hybridzero.utils import __all__ as _FRAGMENT_API

__all__ = [*_FRAGMENT_API, "is_initialized", "logger", "set_z3_leaf_modules"]

logger = logging.getLogger("DeepSpeed")
"""DeepSpeed's logger name: transformers sets its level (``deepspeed.utils.logger.setLevel``)."""

set_z3_leaf_modules = unprovided(
    "deepspeed.utils.set_z3_leaf_modules", "ZeRO-3 leaf modules (MoE); hybridzero gathers per transformer block"
)


def __getattr__(name: str) -> Any:
    raise missing_attribute("deepspeed.utils", name)

"""``deepspeed.utils``: the tensor-fragment API (``safe_get_*`` / ``safe_set_*`` /
``safe_update_full_grad_vectorized``), the ZeRO-3 leaf-module API (``set_z3_leaf_modules`` ...:
:mod:`hybridzero.zero.leaf`), DeepSpeed's ``logger``, ``log_dist``, ``is_initialized``;
``deepspeed.utils.zero_to_fp32`` is a submodule."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from hybridzero.comm import get_rank, is_initialized
from hybridzero.deepspeed_alias.unprovided import missing_attribute
from hybridzero.utils import *  # noqa: F403  (safe_get_* / safe_set_*, as hybridzero.utils.__all__ lists them)
from hybridzero.utils import __all__ as _FRAGMENT_API
from hybridzero.zero.leaf import (
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)

__all__ = [
    *_FRAGMENT_API,
    "get_z3_leaf_modules",
    "is_initialized",
    "log_dist",
    "logger",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
]

logger = logging.getLogger("DeepSpeed")
"""DeepSpeed's logger name: transformers sets its level (``deepspeed.utils.logger.setLevel``)."""


def log_dist(message: str, ranks: Sequence[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the listed ranks (``-1`` in ``ranks``: every rank; default: rank 0), as DeepSpeed's."""
    rank = get_rank() if is_initialized() else 0
    chosen = [0] if ranks is None else list(ranks)
    if rank in chosen or -1 in chosen:
        logger.log(level, f"[Rank {rank}] {message}")


def __getattr__(name: str) -> Any:
    raise missing_attribute("deepspeed.utils", name)

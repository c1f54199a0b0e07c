"""``deepspeed`` served by hybridzero (see :mod:`hybridzero.deepspeed_alias`): hybridzero's top-level DeepSpeed
namespace plus the names DeepSpeed's integrations in transformers and accelerate read from ``deepspeed`` itself.

The submodules those integrations reach by attribute after a bare ``import deepspeed`` (``deepspeed.runtime.
lr_schedules``, ``deepspeed.zero``, ``deepspeed.comm``, ``deepspeed.utils``) are imported here, as DeepSpeed's own
``__init__`` does. Any other name fails with an ``AttributeError`` naming it.
"""

from __future__ import annotations

from typing import Any

from hybridzero import (
    ConfigError,
    Engine,
    GatheredParameters,
    PeerFailure,
    add_config_arguments,
    from_pretrained,
    get_accelerator,
    init_distributed,
    initialize,
)
from hybridzero.deepspeed_alias.finder import alias_version
from hybridzero.deepspeed_alias.unprovided import missing_attribute, unprovided

from . import comm, runtime, utils, zero
from .runtime import engine, lr_schedules  # noqa: F401  (deepspeed.runtime.lr_schedules... reached by attribute)
from .runtime import zero as _runtime_zero  # noqa: F401
from .runtime.activation_checkpointing import checkpointing
from .runtime.engine import DeepSpeedEngine

__all__ = [
    "ConfigError",
    "DeepSpeedEngine",
    "Engine",
    "GatheredParameters",
    "PeerFailure",
    "add_config_arguments",
    "checkpointing",
    "comm",
    "from_pretrained",
    "get_accelerator",
    "init_distributed",
    "initialize",
    "runtime",
    "tp_model_init",
    "utils",
    "zero",
]
__version__ = alias_version()
__git_hash__ = None
__git_branch__ = None

tp_model_init = unprovided("deepspeed.tp_model_init", "automatic tensor parallelism (tensor_parallel.autotp_size > 1)")


def __getattr__(name: str) -> Any:
    raise missing_attribute("deepspeed", name)

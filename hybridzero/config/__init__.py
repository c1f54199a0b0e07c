"""hybridzero's configuration: DeepSpeed JSON in, one typed frozen :class:`Config` (pydantic) out.

    >>> cfg = load_config({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}}, world_size=2)
    >>> (cfg.train_batch_size, cfg.zero.stage, cfg.zero.overlap_comm)
    (8, 3, True)

This package is the single source of config defaults (:mod:`.schema`, :mod:`.models`, :mod:`.optim`); optimizer
and scheduler params are validated by :mod:`.optim` for every caller.
"""

from __future__ import annotations

from .batch import resolve_batch_sizes
from .errors import ConfigError
from .load import AcceptedKey, accepted_keys, load_config, notes
from .models import BF16Config, FP16Config, HybridEngineConfig, OffloadConfig, ParamOffloadConfig, ZeroConfig
from .optim import (
    OptimizerConfig,
    SchedulerConfig,
    canonical_optimizer_type,
    canonical_scheduler_type,
    optimizer_defaults,
    scheduler_defaults,
    validate_optimizer_params,
    validate_scheduler_params,
)
from .schema import Config

__all__ = [
    "AcceptedKey",
    "BF16Config",
    "Config",
    "ConfigError",
    "FP16Config",
    "HybridEngineConfig",
    "OffloadConfig",
    "ParamOffloadConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "ZeroConfig",
    "accepted_keys",
    "canonical_optimizer_type",
    "canonical_scheduler_type",
    "load_config",
    "notes",
    "optimizer_defaults",
    "resolve_batch_sizes",
    "scheduler_defaults",
    "validate_optimizer_params",
    "validate_scheduler_params",
]

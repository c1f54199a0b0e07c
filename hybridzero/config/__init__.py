"""hybridzero's configuration: DeepSpeed JSON in, one typed frozen :class:`Config` out.

    >>> cfg = load_config({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}}, world_size=2)
    >>> (cfg.train_batch_size, cfg.zero.stage, cfg.zero.overlap_comm)
    (8, 3, True)

This package is the single source of config defaults; see :mod:`.schema`.
"""

from __future__ import annotations

from .batch import resolve_batch_sizes
from .deepspeed import load_config
from .errors import ConfigError
from .schema import (
    BF16Config,
    Config,
    FP16Config,
    HybridEngineConfig,
    OffloadConfig,
    OptimizerConfig,
    SchedulerConfig,
    ZeroConfig,
)

__all__ = [
    "BF16Config",
    "Config",
    "ConfigError",
    "FP16Config",
    "HybridEngineConfig",
    "OffloadConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "ZeroConfig",
    "load_config",
    "resolve_batch_sizes",
]

"""``deepspeed.runtime.zero.leaf_module_config``: the ``zero_optimization.leaf_module`` block's defaults and model
(:class:`hybridzero.config.models.LeafModuleConfig`; values are tuples where DeepSpeed has lists)."""

from __future__ import annotations

from hybridzero.config.models import DEFAULT_LEAF_MODULE_CLASSES as _CLASSES
from hybridzero.config.models import LeafModuleConfig

__all__ = [
    "DEFAULT_LEAF_MODULE_CLASSES",
    "DEFAULT_LEAF_MODULE_NAMES",
    "DEFAULT_LEAF_MODULE_NAME_SUFFIXES",
    "DeepSpeedZeroLeafModuleConfig",
]

DEFAULT_LEAF_MODULE_CLASSES: list[str] = list(_CLASSES)
DEFAULT_LEAF_MODULE_NAMES: list[str] = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list[str] = []
DeepSpeedZeroLeafModuleConfig = LeafModuleConfig

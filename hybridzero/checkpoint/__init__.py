"""Checkpoint loading: lazy, shard-aware tensor sources (see :mod:`hybridzero.checkpoint.hf_source`)."""

from hybridzero.checkpoint.hf_source import (
    CheckpointFileError,
    HFCheckpointSource,
    ModuleSource,
    TensorSource,
    resolve_name,
)

__all__ = [
    "CheckpointFileError",
    "HFCheckpointSource",
    "ModuleSource",
    "TensorSource",
    "resolve_name",
]

"""Checkpoints on disk and tensor sources: the engine format (:mod:`~hybridzero.checkpoint.format`, written by
:mod:`~hybridzero.checkpoint.writer`), tag paths (:mod:`~hybridzero.checkpoint.paths`), Hugging Face safetensors
(:mod:`~hybridzero.checkpoint.hf_source`), export (:mod:`~hybridzero.checkpoint.export`) and conversion of the
old pickle-based format 1 (:func:`convert_v1`). Never imports the engine: saving and loading an engine is
:mod:`hybridzero.runtime.checkpointing`."""

from hybridzero.checkpoint.convert import convert_v1
from hybridzero.checkpoint.format import SavedSource, SavedTag, open_tag, verify_tag
from hybridzero.checkpoint.hf_source import CheckpointFileError, HFCheckpointSource, ModuleSource
from hybridzero.checkpoint.paths import CheckpointError, check_tag, find_tag, list_tags, read_latest
from hybridzero.tensor_source import TensorSource, resolve_name

__all__ = [
    "CheckpointError",
    "CheckpointFileError",
    "HFCheckpointSource",
    "ModuleSource",
    "SavedSource",
    "SavedTag",
    "TensorSource",
    "check_tag",
    "convert_v1",
    "find_tag",
    "list_tags",
    "open_tag",
    "read_latest",
    "resolve_name",
    "verify_tag",
]

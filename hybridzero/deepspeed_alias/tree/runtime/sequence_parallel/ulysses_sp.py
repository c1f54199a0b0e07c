"""``deepspeed.runtime.sequence_parallel.ulysses_sp``: DeepSpeed's ALST/Ulysses entry points Hugging Face
Accelerate calls for ``ParallelismConfig(sp_backend="deepspeed")`` --
``UlyssesSPAttentionHF.register_with_transformers`` (:mod:`hybridzero.runtime.ulysses_hf`) and
``UlyssesSPDataLoaderAdapter`` (:mod:`hybridzero.runtime.ulysses_data`), both on hybridzero's own Ulysses attention."""

from __future__ import annotations

from typing import Any

from hybridzero.deepspeed_alias.unprovided import missing_attribute
from hybridzero.runtime.ulysses_data import UlyssesDataLoaderAdapter as UlyssesSPDataLoaderAdapter
from hybridzero.runtime.ulysses_hf import UlyssesSPAttentionHF

__all__ = ["UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter"]


def __getattr__(name: str) -> Any:
    raise missing_attribute("deepspeed.runtime.sequence_parallel.ulysses_sp", name)

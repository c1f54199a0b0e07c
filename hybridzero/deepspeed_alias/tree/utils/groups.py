"""``deepspeed.utils.groups``: the sequence-parallel and data-parallel getters Hugging Face's loss aggregation and
Accelerate's Ulysses data loader call (:mod:`hybridzero.runtime.sp_state`; without a Ulysses registration they
answer as DeepSpeed does without an mpu: no SP group, the world as the data-parallel group)."""

from __future__ import annotations

from typing import Any

from hybridzero.deepspeed_alias.unprovided import missing_attribute
from hybridzero.runtime import sp_state

__all__: list[str] = []  # DeepSpeed's getters are underscored: imported by name, never with *

_get_sequence_parallel_group = sp_state.groups_sequence_parallel_group
_get_sequence_parallel_world_size = sp_state.groups_sequence_parallel_world_size
_get_sequence_parallel_rank = sp_state.groups_sequence_parallel_rank
_get_data_parallel_group = sp_state.groups_data_parallel_group
_get_data_parallel_world_size = sp_state.groups_data_parallel_world_size
_get_data_parallel_rank = sp_state.groups_data_parallel_rank
_get_sequence_data_parallel_group = sp_state.groups_sequence_data_parallel_group
_get_sequence_data_parallel_world_size = sp_state.groups_sequence_data_parallel_world_size
_get_sequence_data_parallel_rank = sp_state.groups_sequence_data_parallel_rank


def __getattr__(name: str) -> Any:
    raise missing_attribute("deepspeed.utils.groups", name)

"""``deepspeed.runtime.sequence_parallel.parallel_state_sp``: the Ulysses groups' process-global getters
(:mod:`hybridzero.runtime.sp_state`); ``deepspeed.initialize(mpu=<this module>)`` uses the active groups."""

from __future__ import annotations

from typing import Any

from hybridzero.deepspeed_alias.unprovided import missing_attribute
from hybridzero.runtime.sp_state import (
    active_groups,
    destroy_sequence_parallel,
    get_data_parallel_group,
    get_data_parallel_rank,
    get_data_parallel_world_size,
    get_sequence_data_parallel_group,
    get_sequence_data_parallel_rank,
    get_sequence_data_parallel_world_size,
    get_sequence_parallel_group,
    get_sequence_parallel_rank,
    get_sequence_parallel_world_size,
    initialize_sequence_parallel,
)

__all__ = [
    "active_groups",
    "destroy_sequence_parallel",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_sequence_data_parallel_group",
    "get_sequence_data_parallel_rank",
    "get_sequence_data_parallel_world_size",
    "get_sequence_parallel_group",
    "get_sequence_parallel_rank",
    "get_sequence_parallel_world_size",
    "initialize_sequence_parallel",
]


def __getattr__(name: str) -> Any:
    raise missing_attribute("deepspeed.runtime.sequence_parallel.parallel_state_sp", name)

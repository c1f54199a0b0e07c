"""DeepSpeed's process-global names for the Ulysses groups: ``deepspeed.runtime.sequence_parallel.parallel_state_sp``
(``initialize_sequence_parallel`` and the ``get_sequence_*`` getters) and the sequence/data-parallel getters of
``deepspeed.utils.groups`` that Hugging Face's loss aggregation and Accelerate's data loader adapter call.

All read the one active registration (:data:`hybridzero.runtime.ulysses_hf.REGISTRY`). Without one, the
``deepspeed.utils.groups`` getters answer as DeepSpeed does without an mpu: no SP group (``None``, size 1, rank 0)
and the whole world as the data-parallel group; the ``parallel_state_sp`` getters raise, naming what to call first.
"""

from __future__ import annotations

from typing import Any

from hybridzero import comm as dist  # deepspeed.comm's face: torch.distributed's own functions, re-exported
from hybridzero.runtime.ulysses_hf import REGISTRY, SequenceParallelGroups, unregister_from_transformers

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
    "groups_data_parallel_group",
    "groups_data_parallel_rank",
    "groups_data_parallel_world_size",
    "groups_sequence_data_parallel_group",
    "groups_sequence_data_parallel_rank",
    "groups_sequence_data_parallel_world_size",
    "groups_sequence_parallel_group",
    "groups_sequence_parallel_rank",
    "groups_sequence_parallel_world_size",
    "initialize_sequence_parallel",
]


def active_groups() -> SequenceParallelGroups | None:
    """The active registration (``deepspeed.initialize(mpu=parallel_state_sp)`` resolves the module to it)."""
    return REGISTRY.active


def _required() -> SequenceParallelGroups:
    groups = REGISTRY.active
    if groups is None:
        raise RuntimeError(
            "sequence parallel group is not initialized: call UlyssesSPAttentionHF.register_with_transformers(...) "
            "or parallel_state_sp.initialize_sequence_parallel(sequence_parallel_size) first"
        )
    return groups


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Form the SP and DP groups (every rank together) without switching a model: the engine built with
    ``mpu=parallel_state_sp`` switches its model to Ulysses attention."""
    REGISTRY.check_free()
    REGISTRY.set(SequenceParallelGroups(sequence_parallel_size))


def destroy_sequence_parallel() -> None:
    """Forget the groups (and give a registered model its attention back)."""
    unregister_from_transformers()


def get_sequence_parallel_group() -> Any:
    return _required().get_sequence_parallel_group()


def get_sequence_parallel_world_size() -> int:
    return _required().get_sequence_parallel_world_size()


def get_sequence_parallel_rank() -> int:
    return _required().get_sequence_parallel_rank()


def get_sequence_data_parallel_group() -> Any:
    return _required().get_sequence_data_parallel_group()


def get_sequence_data_parallel_world_size() -> int:
    return _required().get_sequence_data_parallel_world_size()


def get_sequence_data_parallel_rank() -> int:
    return _required().get_sequence_data_parallel_rank()


def get_data_parallel_group() -> Any:
    return _required().get_data_parallel_group()


def get_data_parallel_world_size() -> int:
    return _required().get_data_parallel_world_size()


def get_data_parallel_rank() -> int:
    return _required().get_data_parallel_rank()


# --- deepspeed.utils.groups: DeepSpeed's answers without an mpu when nothing is registered -----------------------
def groups_sequence_parallel_group() -> Any:
    groups = REGISTRY.active
    return None if groups is None else groups.get_sequence_parallel_group()


def groups_sequence_parallel_world_size() -> int:
    groups = REGISTRY.active
    return 1 if groups is None else groups.get_sequence_parallel_world_size()


def groups_sequence_parallel_rank() -> int:
    groups = REGISTRY.active
    return 0 if groups is None else groups.get_sequence_parallel_rank()


def groups_data_parallel_group() -> Any:
    groups = REGISTRY.active
    return dist.get_world_group() if groups is None else groups.get_data_parallel_group()


def groups_data_parallel_world_size() -> int:
    groups = REGISTRY.active
    return dist.get_world_size() if groups is None else groups.get_data_parallel_world_size()


def groups_data_parallel_rank() -> int:
    groups = REGISTRY.active
    return dist.get_rank() if groups is None else groups.get_data_parallel_rank()


def groups_sequence_data_parallel_group() -> Any:
    """All ranks, registered or not (ZeRO shards over the whole world)."""
    return dist.get_world_group()


def groups_sequence_data_parallel_world_size() -> int:
    return dist.get_world_size()


def groups_sequence_data_parallel_rank() -> int:
    return dist.get_rank()

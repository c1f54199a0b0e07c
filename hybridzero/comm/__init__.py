"""``hybridzero.comm``: DeepSpeed's ``deepspeed.comm`` face, and the package of hybridzero's own communication.

The public functions are ``torch.distributed``'s, re-exported unchanged (same signatures, same semantics, as
``deepspeed.comm`` mirrors them), plus DeepSpeed's ``init_distributed`` and ``get_local_rank``. hybridzero's engine
never calls them: its collectives go through :class:`hybridzero.comm.collectives.Comm` (ledger, failure propagation).
This module, ``collectives.py`` and ``process_group.py`` are the only importers of ``torch.distributed``.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch.distributed as dist
from torch.distributed import (
    ReduceOp,
    all_gather,
    all_gather_into_tensor,
    all_gather_object,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    broadcast_object_list,
    destroy_process_group,
    gather,
    get_backend,
    get_global_rank,
    irecv,
    isend,
    new_group,
    recv,
    reduce,
    reduce_scatter_tensor,
    scatter,
    send,
)

from hybridzero.comm import collectives

__all__ = [
    "ReduceOp",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "destroy_process_group",
    "gather",
    "get_backend",
    "get_global_rank",
    "get_local_rank",
    "get_rank",
    "get_world_group",
    "get_world_size",
    "init_distributed",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter_tensor",
    "scatter",
    "send",
]

_DEFAULT_PORT = 29500  # DeepSpeed's TORCH_DISTRIBUTED_DEFAULT_PORT


def is_available() -> bool:
    """True when torch was built with distributed support."""
    return dist.is_available()


def is_initialized() -> bool:
    """True once the default process group exists."""
    return dist.is_available() and dist.is_initialized()


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (the world by default)."""
    return dist.get_rank(group)


def get_world_size(group: Any = None) -> int:
    """Ranks in ``group`` (the world by default)."""
    return dist.get_world_size(group)


def get_world_group() -> Any:
    """The default (world) process group, as DeepSpeed's ``get_world_group`` answers (``None`` before one exists)."""
    return dist.group.WORLD


def get_local_rank() -> int:
    """This process's rank on its node (``LOCAL_RANK`` from the launcher; 0 without one)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = _DEFAULT_PORT,
    verbose: bool = True,
    timeout: datetime.timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """DeepSpeed's ``init_distributed``: the default process group from the launcher's environment (idempotent).

    gloo on CPU, NCCL with CUDA (``dist_backend`` overrides). ``rank``/``world_size`` stand in for a missing
    ``RANK``/``WORLD_SIZE``; ``distributed_port`` for a missing ``MASTER_PORT`` when not left at DeepSpeed's default
    (a plain process then picks a free port). Without a launcher a plain process is a world of 1.
    ``dist_init_required=False`` does nothing. ``auto_mpi_discovery``, ``verbose`` and ``config`` are accepted and
    unused; an ``init_method`` other than ``env://`` is an error.
    """
    if dist_init_required is False:
        return
    if init_method not in (None, "env://"):
        raise ValueError(
            f"init_distributed(init_method={init_method!r}) is not supported; valid: None or 'env://' "
            f"(set MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE, as torchrun does)"
        )
    if (rank < 0) != (world_size < 0):
        raise ValueError(
            f"init_distributed: give both rank and world_size or neither (rank={rank}, world_size={world_size})"
        )
    if not is_initialized():
        if rank >= 0:
            os.environ.setdefault("RANK", str(rank))
            os.environ.setdefault("WORLD_SIZE", str(world_size))
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if distributed_port != _DEFAULT_PORT or rank >= 0:
            os.environ.setdefault("MASTER_PORT", str(distributed_port))
    collectives.init_distributed(dist_backend, None if timeout is None else timeout.total_seconds())

"""The default process group's life: set up from torchrun's environment, this rank's place in a group, torn down
after a failure. With ``comm/__init__.py`` and ``comm/collectives.py`` the only importers of ``torch.distributed``.

Invariant: without a process group a plain process is a world of size 1 (rank 0), never an error.
"""

from __future__ import annotations

import datetime
import gc
import os
import socket
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 600.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed(backend: str | None = None, timeout_s: float | None = None) -> None:
    """Initialise the default process group from torchrun's environment (idempotent).

    gloo on CPU, NCCL when CUDA is available (``backend`` overrides). Without torchrun's variables a plain process
    becomes a world of size 1. ``timeout_s`` (default ``$HYBRIDZERO_TIMEOUT_S`` or 600) bounds every collective, so a
    dead peer turns into an error instead of a hang.
    """
    if dist.is_available() and dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if timeout_s is None:
        timeout_s = float(os.environ.get("HYBRIDZERO_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    timeout = datetime.timedelta(seconds=timeout_s)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group(backend, rank=0, world_size=1, timeout=timeout)
        return
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timeout)


def world_info(group: Any | None) -> tuple[int, int]:
    """This rank and the size of ``group`` (``None`` = the default group); ``(0, 1)`` without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def abort_process_group() -> None:
    """Tear the default process group down so peers blocked on this rank fail fast (after ``post_failure``)."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
            gc.collect()  # drop the last references so the transport closes its connections now
        except Exception:  # noqa: BLE001 - best effort while failing
            pass

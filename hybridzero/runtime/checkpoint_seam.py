"""The seam between the engine and its checkpoint code (:mod:`hybridzero.runtime.checkpointing` loads,
:mod:`hybridzero.runtime.checkpoint_save` saves, :mod:`hybridzero.runtime.weights16` exports): what the checkpointer
reads and restores on an engine (:class:`Checkpointable`), and the agreement every failure goes through.

Invariant: every failure is agreed on by all ranks with one collective (:func:`agree`) before anything is published
or written, so every rank raises the same :class:`~hybridzero.checkpoint.CheckpointError` (naming the rank, file
and check) at once and the job stays usable (no posted failure, no hang).
"""

from __future__ import annotations

import os
from typing import Any, Protocol

import torch
from torch import nn

from hybridzero.checkpoint.paths import CheckpointError
from hybridzero.comm.collectives import Comm
from hybridzero.optim.loss_scaler import LossScaler
from hybridzero.runtime.zero_optimizer import ZeroOptimizer
from hybridzero.zero.groups import ShardedGroup

_PHASE = "checkpoint"


class Checkpointable(Protocol):
    """What the checkpointer reads and restores on an engine."""

    comm: Comm
    module: nn.Module
    groups: list[ShardedGroup]
    optimizer: ZeroOptimizer | None
    lr_scheduler: Any
    loss_scaler: LossScaler
    global_steps: int
    micro_steps: int
    skipped_steps: int
    compute_dtype: torch.dtype
    config: Any

    @property
    def gradient_accumulation_steps(self) -> int: ...

    @property
    def global_samples(self) -> int: ...

    def assert_quiescent(self) -> None: ...

    def release_held(self) -> None: ...

    def zero_grad(self) -> None: ...

    def _get_optimizer_ckpt_name(
        self, checkpoints_path: str | os.PathLike[str], tag: Any, expp_rank: int = 0
    ) -> str: ...


def agree(comm: Comm, error: str | None, what: str) -> None:
    """Raise CheckpointError on every rank if any rank reports an error (one object all-gather)."""
    raise_failed(comm.all_gather_object(error, phase=_PHASE), what)


def raise_failed(errors: list[str | None], what: str) -> None:
    """CheckpointError naming every rank's error, if any rank has one (``errors``: one entry per rank)."""
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
    if failed:
        raise CheckpointError(
            f"{what} failed on {len(failed)} of {len(errors)} ranks, nothing was changed: " + "; ".join(failed)
        )


def describe(exc: BaseException) -> str:
    """``Type: message`` of an exception (what the agreement reports)."""
    return f"{type(exc).__name__}: {exc}"

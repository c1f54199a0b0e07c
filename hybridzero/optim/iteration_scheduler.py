"""The torch ``LRScheduler`` base of DeepSpeed's schedules (:mod:`hybridzero.optim.schedulers`,
:mod:`hybridzero.optim.cycle_schedulers`): a closed form of DeepSpeed's iteration, DeepSpeed's state dict.

Step convention.  DeepSpeed's ``last_batch_iteration`` starts at -1 (the *pre-start* values set when the scheduler is
built) and its engine calls ``scheduler.step()`` after every successful ``optimizer.step()``.  Here
``last_epoch == last_batch_iteration + 1`` (torch's constructor performs one step, taking ``last_epoch`` from -1 to
0), so driving either the same way gives the same sequence.

Invariants: every ``step()`` sets each group's lr to the closed form of the next iteration (:meth:`lrs_at`, never
computed from the current lr); ``state_dict()`` holds only the position (the schedule's parameters come from the
config, as in DeepSpeed); ``load_state_dict`` also takes DeepSpeed's own ``{"last_batch_iteration": i}``; neither
touches the optimizer.
"""

from __future__ import annotations

import abc
import math
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

__all__ = ["IterationScheduler", "check_resume_iteration", "copy_lr", "number", "per_group"]


def copy_lr(lr: float | torch.Tensor) -> float | torch.Tensor:
    """A copy of a group lr that does not alias it (tensor lrs are cloned)."""
    return lr.clone() if isinstance(lr, torch.Tensor) else lr


def number(key: str, value: Any) -> float:
    """A finite, non-negative real number (bools rejected), else ``ValueError`` naming key."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"scheduler param {key!r} must be a finite number, got {value!r}")
    if value < 0:
        raise ValueError(f"scheduler param {key!r} must be >= 0, got {value!r}")
    return float(value)


def per_group(key: str, value: Any, num_groups: int) -> list[float]:
    """Broadcast a scalar, or validate a per-group list/tuple, to ``num_groups`` floats."""
    if isinstance(value, (list, tuple)):
        if len(value) != num_groups:
            raise ValueError(
                f"scheduler param {key!r} has {len(value)} values but the optimizer has "
                f"{num_groups} param groups: {value!r}"
            )
        return [number(key, item) for item in value]
    return [number(key, value)] * num_groups


def check_resume_iteration(value: Any) -> int:
    """DeepSpeed's ``last_batch_iteration`` parameter: an int >= -1, else ``ValueError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise ValueError(f"scheduler param 'last_batch_iteration' must be an int >= -1, got {value!r}")
    return value


class IterationScheduler(LRScheduler, abc.ABC):
    """A DeepSpeed schedule as a torch ``LRScheduler`` (see the module docstring); subclasses give :meth:`lrs_at`
    and call :meth:`start` at the end of their constructor."""

    def start(self, optimizer: torch.optim.Optimizer, resume_at: int) -> None:
        """Run torch's constructor (applying the pre-start lrs) or, for ``resume_at >= 0``, position at that
        iteration leaving the optimizer's lrs as they were (DeepSpeed applies nothing when resuming)."""
        current = [copy_lr(group["lr"]) for group in optimizer.param_groups]
        super().__init__(optimizer, last_epoch=-1)
        if resume_at < 0:
            return
        for group, lr in zip(optimizer.param_groups, current):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].copy_(torch.as_tensor(lr))
            else:
                group["lr"] = lr
        self.last_epoch = resume_at + 1
        self._last_lr = [copy_lr(group["lr"]) for group in optimizer.param_groups]

    def step(self, batch_iteration: int | None = None, *, last_batch_iteration: int | None = None) -> None:
        """DeepSpeed's ``step``: the next iteration, or ``batch_iteration`` (``last_batch_iteration``, the name
        DeepSpeed's warmup classes use) when given; the lrs become that iteration's closed form."""
        target = batch_iteration if batch_iteration is not None else last_batch_iteration
        if target is not None:
            self.last_epoch = check_resume_iteration(target)  # torch's step adds one: the iteration is `target`
        super().step()

    @abc.abstractmethod
    def lrs_at(self, iteration: int) -> list[float]:
        """Closed-form lrs of every group at DeepSpeed iteration ``iteration`` (>= -1)."""

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's iteration counter: -1 right after construction."""
        return self.last_epoch - 1

    def get_lr(self) -> list[float]:  # type: ignore[override]
        """Lrs for the current ``last_epoch`` (torch calls this inside ``step()``)."""
        return self.lrs_at(self.last_batch_iteration)

    def state_dict(self) -> dict[str, Any]:
        """Position of the schedule only (see the module docstring)."""
        return {
            "last_batch_iteration": self.last_batch_iteration,
            "last_epoch": self.last_epoch,
            "_step_count": self._step_count,
            "_last_lr": list(self._last_lr),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the position from :meth:`state_dict` or a DeepSpeed scheduler state."""
        if "last_batch_iteration" not in state_dict:
            raise ValueError(f"scheduler state_dict lacks 'last_batch_iteration': keys {sorted(state_dict)!r}")
        iteration = state_dict["last_batch_iteration"]
        if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < -1:
            raise ValueError(f"state_dict 'last_batch_iteration' must be an int >= -1, got {iteration!r}")
        self.last_epoch = iteration + 1
        self._step_count = int(state_dict.get("_step_count", iteration + 2))
        saved = state_dict.get("_last_lr")
        restored: list[float | torch.Tensor] = list(saved) if saved is not None else list(self.lrs_at(iteration))
        self._last_lr = restored

"""DeepSpeed's OneCycle and LRRangeTest schedules (the config's ``scheduler.type``), as torch LR schedulers.

Same step convention as the warmup schedules (:mod:`hybridzero.optim.iteration_scheduler`): ``i`` is DeepSpeed's
``last_batch_iteration``, -1 at construction, +1 at every ``step()``; ``b = i + 1``.

LRRangeTest: ``lr = min_lr * (1 + step_rate * t)`` with ``t = b / step_size`` (``floor`` of it with
``staircase``); at construction (``b = 0``) ``min_lr``.

OneCycle, with ``F``/``S`` the first/second half sizes (``S`` defaults to ``F``), ``T = F + S``:

* while ``i < T`` (the cycle): ``x = b / T - floor(b / T)``; scale ``s = x / (F / T)`` rising, else
  ``(x - 1) / (F / T - 1)`` falling; with a stair count ``c > 0`` for that half, ``s = floor(p) / c`` where ``p`` is
  ``(b mod T) * c / F`` rising or ``(T - b mod T) * c / S`` falling (DeepSpeed quantises from the integer offset);
  ``lr = min_lr + (max_lr - min_lr) * s``; momentum ``beta1 = max_mom - (max_mom - min_mom) * s``;
* after it, with ``k = i - T + 1``: ``lr = min_lr / (1 + decay_lr_rate * k / decay_step_size)`` and
  ``beta1 = max_mom * (1 + decay_mom_rate * k / decay_step_size)``, or constant ``min_lr`` / ``max_mom`` when
  ``decay_step_size`` or the rate is 0.

DeepSpeed's choices reproduced so a run gives its curve: momentum cycles only optimizers whose ``defaults`` have
``betas`` (Adam(W), Lion; not SGD: DeepSpeed logs that it is disabled, and so does this); the cycled ``betas`` are
``(beta1, 0.99)``, i.e. OneCycle replaces the optimizer's ``beta2`` by 0.99; at construction (iteration -1) the lr
is ``min_lr`` and ``beta1`` is ``min_mom``, although the formula gives ``max_mom`` there. The schedules' params are
checked by :mod:`hybridzero.config.optim` (names, types, ranges; ``cycle_min_lr``/``cycle_max_lr`` required).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hybridzero.config import validate_scheduler_params
from hybridzero.optim.iteration_scheduler import IterationScheduler, check_resume_iteration, per_group

__all__ = ["CycleShape", "OneCycleScheduler", "RangeTestScheduler", "one_cycle_scale", "range_test_factor"]

_LOG = logging.getLogger(__name__)
_BETA2 = 0.99  # DeepSpeed's OneCycle sets betas = (cycled beta1, 0.99)


def range_test_factor(iteration: int, *, step_size: int, step_rate: float, staircase: bool) -> float:
    """LRRangeTest's multiplier of ``min_lr`` at DeepSpeed iteration ``iteration`` (>= -1)."""
    interval = (iteration + 1) / step_size
    return 1.0 + step_rate * (math.floor(interval) if staircase else interval)


@dataclass(frozen=True)
class CycleShape:
    """OneCycle's cycle: half sizes (``first > 0``, ``second >= 0``) and stair counts (0: continuous)."""

    first: int
    second: int
    first_stairs: int
    second_stairs: int

    @property
    def total(self) -> int:
        """Iterations in the cycle."""
        return self.first + self.second


def one_cycle_scale(iteration: int, shape: CycleShape) -> float:
    """OneCycle's position in ``[0, 1]`` within the cycle at DeepSpeed iteration ``iteration`` (module docstring)."""
    b, total = iteration + 1, shape.total
    ratio = shape.first / total
    x = 1.0 + b / total - math.floor(1 + b / total)
    if x <= ratio:
        scale, stairs = x / ratio, shape.first_stairs
    else:
        scale, stairs = (x - 1) / (ratio - 1), shape.second_stairs
    if stairs > 0:
        offset = b % total
        if offset <= shape.first:
            position = offset * stairs / shape.first
        else:
            position = (total - offset) * stairs / shape.second
        scale = math.floor(position) / stairs
    return scale


class RangeTestScheduler(IterationScheduler):
    """DeepSpeed's LRRangeTest (module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: Mapping[str, Any]) -> None:
        params = validate_scheduler_params("LRRangeTest", params)
        self.sched_type = "LRRangeTest"
        self.min_lrs = per_group(
            "lr_range_test_min_lr", params.get("lr_range_test_min_lr", 1e-3), len(optimizer.param_groups)
        )
        self.step_size = int(params.get("lr_range_test_step_size", 2000))
        self.step_rate = float(params.get("lr_range_test_step_rate", 1.0))
        self.staircase = bool(params.get("lr_range_test_staircase", False))
        self.start(optimizer, check_resume_iteration(params.get("last_batch_iteration", -1)))

    def lrs_at(self, iteration: int) -> list[float]:
        """``min_lr`` times the range test's factor, per group."""
        factor = range_test_factor(
            iteration, step_size=self.step_size, step_rate=self.step_rate, staircase=self.staircase
        )
        return [lo * factor for lo in self.min_lrs]


class OneCycleScheduler(IterationScheduler):
    """DeepSpeed's OneCycle: cycles the lr and, for optimizers with ``betas``, ``beta1`` (module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: Mapping[str, Any]) -> None:
        params = validate_scheduler_params("OneCycle", params)
        self.sched_type = "OneCycle"
        n = len(optimizer.param_groups)
        first = int(params.get("cycle_first_step_size", 2000))
        second = params.get("cycle_second_step_size")
        first_stairs = int(params.get("cycle_first_stair_count", 0))
        second_stairs = params.get("cycle_second_stair_count")
        self.shape = CycleShape(
            first=first,
            second=first if second is None else int(second),
            first_stairs=first_stairs,
            second_stairs=first_stairs if second_stairs is None else int(second_stairs),
        )
        self.min_lrs = per_group("cycle_min_lr", params["cycle_min_lr"], n)
        self.max_lrs = per_group("cycle_max_lr", params["cycle_max_lr"], n)
        self.decay_step_size = int(params.get("decay_step_size", 0))
        self.decay_lr_rate = float(params.get("decay_lr_rate", 0.0))
        self.decay_mom_rate = float(params.get("decay_mom_rate", 0.0))
        self.min_moms = per_group("cycle_min_mom", params.get("cycle_min_mom", 0.8), n)
        self.max_moms = per_group("cycle_max_mom", params.get("cycle_max_mom", 0.9), n)
        self.cycle_momentum = bool(params.get("cycle_momentum", True))
        if self.cycle_momentum and "betas" not in optimizer.defaults:
            _LOG.warning(
                "OneCycle: cycle_momentum is disabled because optimizer %s has no betas in its defaults",
                type(optimizer).__name__,
            )
            self.cycle_momentum = False
        resume_at = check_resume_iteration(params.get("last_batch_iteration", -1))
        betas = [group.get("betas") for group in optimizer.param_groups]
        self.start(optimizer, resume_at)
        if resume_at >= 0:  # DeepSpeed applies nothing when resuming: the betas stay as they were
            for group, saved in zip(optimizer.param_groups, betas):
                if saved is not None:
                    group["betas"] = saved
        elif self.cycle_momentum:
            self._set_betas(self.min_moms)

    def lrs_at(self, iteration: int) -> list[float]:
        """Per-group lr: the cycle, then the decay (module docstring)."""
        if iteration < 0:
            return list(self.min_lrs)
        if iteration < self.shape.total:
            scale = one_cycle_scale(iteration, self.shape)
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.decay_step_size == 0 or self.decay_lr_rate == 0.0:
            return list(self.min_lrs)
        factor = 1.0 + self.decay_lr_rate * ((iteration - self.shape.total + 1) / self.decay_step_size)
        return [lo / factor for lo in self.min_lrs]

    def moms_at(self, iteration: int) -> list[float]:
        """Per-group ``beta1``: the cycle (inverse to the lr), then the decay (module docstring)."""
        if iteration < self.shape.total:
            scale = one_cycle_scale(iteration, self.shape)
            return [hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.decay_step_size == 0 or self.decay_mom_rate == 0.0:
            return list(self.max_moms)
        factor = 1.0 + self.decay_mom_rate * ((iteration - self.shape.total + 1) / self.decay_step_size)
        return [hi * factor for hi in self.max_moms]

    def step(self, batch_iteration: int | None = None, *, last_batch_iteration: int | None = None) -> None:
        """Advance one iteration (or go to ``batch_iteration``, as DeepSpeed's ``step``): the lrs and, when cycling
        momentum, every group's ``betas``."""
        super().step(batch_iteration, last_batch_iteration=last_batch_iteration)
        if self.cycle_momentum:
            self._set_betas(self.moms_at(self.last_batch_iteration))

    def _set_betas(self, beta1s: list[float]) -> None:
        """Write ``(beta1, 0.99)`` into every group (DeepSpeed's OneCycle); a decayed ``beta1`` that left ``[0, 1)``
        is an error naming the params that drove it there (Adam would divide by ``1 - beta1**t`` <= 0)."""
        for beta1 in beta1s:
            if not 0.0 <= beta1 < 1.0:
                raise ValueError(
                    f"OneCycle: momentum (beta1) reached {beta1!r} at iteration {self.last_batch_iteration}; "
                    f"scheduler.params.decay_mom_rate = {self.decay_mom_rate!r} with decay_step_size = "
                    f"{self.decay_step_size!r} and cycle_max_mom = {self.max_moms!r} push it to 1 or past: lower them"
                )
        for group, beta1 in zip(self.optimizer.param_groups, beta1s):
            group["betas"] = (beta1, _BETA2)

"""``deepspeed.runtime.lr_schedules``: ``VALID_LR_SCHEDULES`` (the scheduler names a config's ``scheduler.type``
takes; accelerate hands a client scheduler of one of these class names to ``initialize``) and DeepSpeed's five
schedule classes with its constructor signatures, for scripts that build one themselves
(``WarmupDecayLR(optimizer, total_num_steps, warmup_max_lr=...)``). Each is hybridzero's scheduler of that type
(:mod:`hybridzero.optim.schedulers`, :mod:`hybridzero.optim.cycle_schedulers`): the same values as the config's
block, the same checks and errors (naming the param), and DeepSpeed's ``step(batch_iteration)``."""

from __future__ import annotations

from typing import Any

import torch

from hybridzero.optim.cycle_schedulers import OneCycleScheduler, RangeTestScheduler
from hybridzero.optim.schedulers import SUPPORTED_SCHEDULERS, DeepSpeedWarmupScheduler

__all__ = ["VALID_LR_SCHEDULES", "LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]

VALID_LR_SCHEDULES: list[str] = list(SUPPORTED_SCHEDULERS)


def _given(values: dict[str, Any]) -> dict[str, Any]:
    """The named arguments as a config ``params`` block (``None`` meaning "the default", as DeepSpeed's do)."""
    return {k: v for k, v in values.items() if v is not None}


class WarmupLR(DeepSpeedWarmupScheduler):
    """DeepSpeed's ``WarmupLR(optimizer, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=1000,
    warmup_type="log", last_batch_iteration=-1)``; ``warmup_max_lr=None``: each group's current lr."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        params: dict[str, Any] = {
            "warmup_min_lr": warmup_min_lr,
            "warmup_num_steps": warmup_num_steps,
            "warmup_type": warmup_type,
            "last_batch_iteration": last_batch_iteration,
            **_given({"warmup_max_lr": warmup_max_lr}),
        }
        super().__init__(optimizer, "WarmupLR", params)


class WarmupDecayLR(DeepSpeedWarmupScheduler):
    """DeepSpeed's ``WarmupDecayLR(optimizer, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001,
    warmup_num_steps=1000, warmup_type="log", last_batch_iteration=-1)``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        params: dict[str, Any] = {
            "total_num_steps": total_num_steps,
            "warmup_min_lr": warmup_min_lr,
            "warmup_max_lr": warmup_max_lr,
            "warmup_num_steps": warmup_num_steps,
            "warmup_type": warmup_type,
            "last_batch_iteration": last_batch_iteration,
        }
        super().__init__(optimizer, "WarmupDecayLR", params)


class WarmupCosineLR(DeepSpeedWarmupScheduler):
    """DeepSpeed's ``WarmupCosineLR(optimizer, total_num_steps, warmup_min_ratio=0.0, warmup_num_steps=1000,
    cos_min_ratio=0.0001, warmup_type="log", last_batch_iteration=-1)``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        params: dict[str, Any] = {
            "total_num_steps": total_num_steps,
            "warmup_min_ratio": warmup_min_ratio,
            "warmup_num_steps": warmup_num_steps,
            "cos_min_ratio": cos_min_ratio,
            "warmup_type": warmup_type,
            "last_batch_iteration": last_batch_iteration,
        }
        super().__init__(optimizer, "WarmupCosineLR", params)


class OneCycle(OneCycleScheduler):
    """DeepSpeed's ``OneCycle(optimizer, cycle_min_lr, cycle_max_lr, decay_lr_rate=0.0, cycle_first_step_size=2000,
    cycle_second_step_size=None, cycle_first_stair_count=0, cycle_second_stair_count=None, decay_step_size=0,
    cycle_momentum=True, cycle_min_mom=0.8, cycle_max_mom=0.9, decay_mom_rate=0.0, last_batch_iteration=-1)``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        cycle_min_lr: float | list[float],
        cycle_max_lr: float | list[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | list[float] = 0.8,
        cycle_max_mom: float | list[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        params: dict[str, Any] = {
            "cycle_min_lr": cycle_min_lr,
            "cycle_max_lr": cycle_max_lr,
            "decay_lr_rate": decay_lr_rate,
            "cycle_first_step_size": cycle_first_step_size,
            "cycle_first_stair_count": cycle_first_stair_count,
            "decay_step_size": decay_step_size,
            "cycle_momentum": cycle_momentum,
            "cycle_min_mom": cycle_min_mom,
            "cycle_max_mom": cycle_max_mom,
            "decay_mom_rate": decay_mom_rate,
            "last_batch_iteration": last_batch_iteration,
            **_given({"cycle_second_step_size": cycle_second_step_size}),
            **_given({"cycle_second_stair_count": cycle_second_stair_count}),
        }
        super().__init__(optimizer, params)


class LRRangeTest(RangeTestScheduler):
    """DeepSpeed's ``LRRangeTest(optimizer, lr_range_test_min_lr=1e-3, lr_range_test_step_size=2000,
    lr_range_test_step_rate=1.0, lr_range_test_staircase=False, last_batch_iteration=-1)``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        lr_range_test_min_lr: float | list[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        params: dict[str, Any] = {
            "lr_range_test_min_lr": lr_range_test_min_lr,
            "lr_range_test_step_size": lr_range_test_step_size,
            "lr_range_test_step_rate": lr_range_test_step_rate,
            "lr_range_test_staircase": lr_range_test_staircase,
            "last_batch_iteration": last_batch_iteration,
        }
        super().__init__(optimizer, params)

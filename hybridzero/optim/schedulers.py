"""DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR as torch LR schedulers.

Step convention.  ``step`` in the pure functions is DeepSpeed's ``last_batch_iteration``
(0, 1, 2, ...).  DeepSpeed sets a *pre-start* lr when the scheduler is built (iteration -1)
and its engine calls ``scheduler.step()`` after every successful ``optimizer.step()``, so
optimizer step ``k`` (1-based) runs with the lr of iteration ``k - 2``: the first two
optimizer steps both use the pre-start / iteration-0 value.  The scheduler objects here are
``torch.optim.lr_scheduler.LRScheduler`` subclasses with ``last_epoch == iteration + 1``
(torch's constructor performs one step, taking ``last_epoch`` from -1 to 0), so they produce
exactly DeepSpeed's sequence when driven the same way.

Formulas (``N = max(2, warmup_num_steps)``, as DeepSpeed clamps it):

* warmup factor ``g(i)`` for ``i < N``: ``log(i + 1) * (1 / log N)`` ("log") or ``i / N``
  ("linear"); ``1.0`` afterwards.
* WarmupLR: ``lr = min_lr + (max_lr - min_lr) * g(i)``; pre-start lr = ``min_lr``.
* WarmupDecayLR: as WarmupLR during warmup, then
  ``g = max(0, (total - i) / max(1, total - N))`` (reaches 0 at ``i == total``).
* WarmupCosineLR (a ratio of each group's lr at construction): during warmup
  ``r = min_ratio + g(i) * (1 - min_ratio)``; then with ``s = i - N + 1`` and
  ``T = max(1, total - N)``: ``r = max(0, cos_min + (1 - cos_min) * (1 + cos(pi * min(1, s / T))) / 2)``
  (DeepSpeed 0.19 clamps the progress: past ``total`` the ratio stays at ``cos_min``).
  Pre-start lr = 0.0 for every group.  ``total_num_steps`` below the warmup is logged, as by DeepSpeed.

Defaults (DeepSpeed's): warmup_min_lr=0.0, warmup_num_steps=1000, warmup_type="log";
WarmupLR's warmup_max_lr defaults to each group's current lr, WarmupDecayLR's to 0.001;
WarmupCosineLR: warmup_min_ratio=0.0, cos_min_ratio=1e-4.  ``total_num_steps`` is required
for the decaying schedules.  Type names match case-insensitively; names, types and ranges of
``params`` are checked by :mod:`hybridzero.config.optim` (the rules of the config's ``scheduler``
block); unlike DeepSpeed (which warns and carries on), invalid values raise ``ValueError``
(a ``ConfigError`` naming ``scheduler.params.<name>``).  ``last_batch_iteration`` (default -1)
is accepted as in DeepSpeed: a value ``>= 0`` resumes at that iteration and leaves the optimizer's lrs untouched until
the next ``step()``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from hybridzero.config import canonical_scheduler_type, validate_scheduler_params
from hybridzero.config.optim import SCHEDULER_TYPES
from hybridzero.optim.cycle_schedulers import OneCycleScheduler, RangeTestScheduler
from hybridzero.optim.iteration_scheduler import IterationScheduler, check_resume_iteration, number, per_group

__all__ = [
    "SUPPORTED_SCHEDULERS",
    "DeepSpeedWarmupScheduler",
    "build_scheduler",
    "warmup_cosine_lr_ratio",
    "warmup_decay_lr",
    "warmup_lr",
    "warmup_lr_factor",
]

SUPPORTED_SCHEDULERS: tuple[str, ...] = SCHEDULER_TYPES
WARMUP_SCHEDULES: tuple[str, ...] = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
_LOG = logging.getLogger(__name__)
WARMUP_TYPES: tuple[str, ...] = ("log", "linear")
_DECAY_DEFAULT_MAX_LR: float = 0.001
_COS_DEFAULT_MIN_RATIO: float = 0.0001
_DEFAULT_WARMUP_STEPS: int = 1000

# ----------------------------------------------------------------------------- pure math


def _effective_warmup_steps(warmup_num_steps: int) -> int:
    """DeepSpeed's clamp: fewer than 2 warmup steps would make ``log(N)`` zero."""
    return max(2, warmup_num_steps)


def _check_step(step: int) -> None:
    """Pure functions take DeepSpeed iterations, which start at 0."""
    if step < 0:
        raise ValueError(f"step must be >= 0 (DeepSpeed's last_batch_iteration), got {step!r}")


def warmup_lr_factor(step: int, *, warmup_num_steps: int, warmup_type: str) -> float:
    """Warmup progress ``gamma`` in ``[0, 1]`` at iteration ``step`` (>= 0).

    ``gamma`` is 0 at step 0; "log" reaches ~1 at ``N - 1``, "linear" reaches ``(N-1)/N``
    there, and both are exactly 1.0 from ``N = max(2, warmup_num_steps)`` on.
    """
    _check_step(step)
    if warmup_type not in WARMUP_TYPES:
        raise ValueError(f"warmup_type={warmup_type!r} is not one of {WARMUP_TYPES}")
    n = _effective_warmup_steps(warmup_num_steps)
    if step >= n:
        return 1.0
    if warmup_type == "log":
        inverse_log = 1.0 / math.log(n)
        return inverse_log * math.log(step + 1)
    return step / n


def warmup_lr(
    step: int,
    *,
    warmup_min_lr: float,
    warmup_max_lr: float,
    warmup_num_steps: int,
    warmup_type: str = "log",
) -> float:
    """WarmupLR's absolute lr at iteration ``step``; constant ``warmup_max_lr`` after warmup."""
    gamma = warmup_lr_factor(step, warmup_num_steps=warmup_num_steps, warmup_type=warmup_type)
    return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma


def warmup_decay_lr(
    step: int,
    *,
    total_num_steps: int,
    warmup_min_lr: float,
    warmup_max_lr: float,
    warmup_num_steps: int,
    warmup_type: str = "log",
) -> float:
    """WarmupDecayLR's absolute lr: warmup, then linear decay reaching ``warmup_min_lr`` at
    ``step == total_num_steps`` and staying there."""
    n = _effective_warmup_steps(warmup_num_steps)
    gamma = warmup_lr_factor(step, warmup_num_steps=n, warmup_type=warmup_type)
    if step >= n:
        gamma = max(0.0, float(total_num_steps - step) / float(max(1.0, total_num_steps - n)))
    return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma


def warmup_cosine_lr_ratio(
    step: int,
    *,
    total_num_steps: int,
    warmup_min_ratio: float,
    warmup_num_steps: int,
    cos_min_ratio: float,
    warmup_type: str = "log",
) -> float:
    """WarmupCosineLR's multiplier of each group's base lr at iteration ``step``.

    Reaches ``cos_min_ratio`` at ``step == total_num_steps - 1`` and stays there (with no cosine window,
    ``total_num_steps <= max(2, warmup_num_steps)``, right after warmup).
    """
    n = _effective_warmup_steps(warmup_num_steps)
    gamma = warmup_lr_factor(step, warmup_num_steps=n, warmup_type=warmup_type)
    if step < n:
        return warmup_min_ratio + gamma * (1.0 - warmup_min_ratio)
    progress = min(1.0, (step - n + 1) / max(1, total_num_steps - n))  # DeepSpeed 0.19's clamp
    cosine = (1 + math.cos(math.pi * progress)) / 2
    return max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * cosine)


# ----------------------------------------------------------------------------- validation


def _int(key: str, value: Any) -> int:
    """A non-negative int (bools rejected), else ``ValueError`` naming the key and value."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"scheduler param {key!r} must be an int >= 0, got {value!r}")
    return value


def _warmup_type(value: Any) -> str:
    """``value`` if it is a supported warmup type, else ``ValueError`` naming key and value."""
    if value not in WARMUP_TYPES:
        raise ValueError(f"scheduler param 'warmup_type' must be one of {WARMUP_TYPES}, got {value!r}")
    return value


def _total_steps(params: Mapping[str, Any], warmup_steps: int) -> int:
    """``total_num_steps`` (required); one shorter than the warmup is DeepSpeed's warning, not an error (a short
    debugging run with the real warmup: the schedule decays straight after the warmup)."""
    if "total_num_steps" not in params:
        raise ValueError("scheduler param 'total_num_steps' is required")
    total = _int("total_num_steps", params["total_num_steps"])
    if total < _effective_warmup_steps(warmup_steps):
        _LOG.warning("total_num_steps %d is less than warmup_num_steps %d", total, warmup_steps)
    return total


# ----------------------------------------------------------------------------- scheduler


class DeepSpeedWarmupScheduler(IterationScheduler):
    """One of DeepSpeed's warmup schedules as a torch ``LRScheduler`` (the position, state dict and step convention
    of :class:`hybridzero.optim.iteration_scheduler.IterationScheduler`); after construction every group's lr is
    DeepSpeed's pre-start value."""

    def __init__(self, optimizer: torch.optim.Optimizer, sched_type: str, params: Mapping[str, Any]) -> None:
        """Validate ``params`` for ``sched_type`` and apply the pre-start lrs."""
        sched_type = canonical_scheduler_type(sched_type)
        if sched_type not in WARMUP_SCHEDULES:
            raise ValueError(
                f"DeepSpeedWarmupScheduler runs {', '.join(WARMUP_SCHEDULES)}, not {sched_type!r}: use build_scheduler"
            )
        params = validate_scheduler_params(sched_type, params)  # the config's rules: names, types, ranges
        self.sched_type = sched_type
        num_groups = len(optimizer.param_groups)
        self.org_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        self.warmup_num_steps = _int("warmup_num_steps", params.get("warmup_num_steps", _DEFAULT_WARMUP_STEPS))
        self.warmup_type = _warmup_type(params.get("warmup_type", "log"))
        if sched_type == "WarmupCosineLR":
            self.total_num_steps = _total_steps(params, self.warmup_num_steps)
            self.warmup_min_ratio = number("warmup_min_ratio", params.get("warmup_min_ratio", 0.0))
            self.cos_min_ratio = number("cos_min_ratio", params.get("cos_min_ratio", _COS_DEFAULT_MIN_RATIO))
        else:
            if sched_type == "WarmupDecayLR":
                self.total_num_steps = _total_steps(params, self.warmup_num_steps)
                default_max: Any = _DECAY_DEFAULT_MAX_LR
            else:
                default_max = self.org_lrs
            self.min_lrs = per_group("warmup_min_lr", params.get("warmup_min_lr", 0.0), num_groups)
            max_value = params.get("warmup_max_lr", default_max)
            # DeepSpeed's WarmupLR.__init__ (shared by WarmupDecayLR) maps an explicit None
            # to the groups' current lrs.
            self.max_lrs = per_group("warmup_max_lr", self.org_lrs if max_value is None else max_value, num_groups)
        self.start(optimizer, check_resume_iteration(params.get("last_batch_iteration", -1)))

    def lrs_at(self, iteration: int) -> list[float]:
        """Closed-form lrs of every group at DeepSpeed iteration ``iteration`` (>= -1)."""
        if iteration < 0:
            if self.sched_type == "WarmupCosineLR":
                return [0.0] * len(self.org_lrs)
            return list(self.min_lrs)
        steps, kind = self.warmup_num_steps, self.warmup_type
        if self.sched_type == "WarmupCosineLR":
            ratio = warmup_cosine_lr_ratio(
                iteration,
                total_num_steps=self.total_num_steps,
                warmup_min_ratio=self.warmup_min_ratio,
                warmup_num_steps=steps,
                cos_min_ratio=self.cos_min_ratio,
                warmup_type=kind,
            )
            return [org_lr * ratio for org_lr in self.org_lrs]
        if self.sched_type == "WarmupDecayLR":
            return [
                warmup_decay_lr(
                    iteration,
                    total_num_steps=self.total_num_steps,
                    warmup_min_lr=lo,
                    warmup_max_lr=hi,
                    warmup_num_steps=steps,
                    warmup_type=kind,
                )
                for lo, hi in zip(self.min_lrs, self.max_lrs)
            ]
        return [
            warmup_lr(iteration, warmup_min_lr=lo, warmup_max_lr=hi, warmup_num_steps=steps, warmup_type=kind)
            for lo, hi in zip(self.min_lrs, self.max_lrs)
        ]


def build_scheduler(sched_type: str, params: Mapping[str, Any], optimizer: torch.optim.Optimizer) -> LRScheduler:
    """Build a DeepSpeed ``scheduler`` block (``type`` + ``params``) over ``optimizer``.

    Construction immediately sets every group's lr to DeepSpeed's pre-start value.  With
    WarmupCosineLR, the base lrs are the groups' lrs at this moment.

    Raises:
        ValueError: unknown type, unknown param, or invalid value (message names both).
    """
    params = {} if params is None else params
    canonical = canonical_scheduler_type(sched_type)
    if canonical == "OneCycle":
        return OneCycleScheduler(optimizer, params)
    if canonical == "LRRangeTest":
        return RangeTestScheduler(optimizer, params)
    return DeepSpeedWarmupScheduler(optimizer, canonical, params)

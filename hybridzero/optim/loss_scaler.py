"""DeepSpeed-compatible fp16 loss scaling: pure state transitions plus a small wrapper.

The dynamic rule reproduces ``DynamicLossScaler.update_scale`` of current DeepSpeed
(``deepspeed/runtime/fp16/loss_scaler.py``, deepspeedai/DeepSpeed master, 2025-2026, the
version that computes ``stable_interval = cur_iter - last_overflow_iter - 1``). DeepSpeed keeps
``cur_iter`` and ``last_overflow_iter`` (initially ``0`` and ``-1``); here the same information
is held explicitly as ``good_steps``, with the invariant (before each update)::

    good_steps == cur_iter - last_overflow_iter - 1 == DeepSpeed's stable_interval

i.e. the number of consecutive non-overflow updates since the last overflow (or since the
start, which DeepSpeed treats as a virtual overflow at iteration -1). ``last_overflow_iter`` is
recovered as ``step - good_steps - 1``.

One update, given ``overflow`` (the flag all-reduced with MAX across ranks):

* overflow, hysteresis exhausted (``hysteresis_left == 1`` or ``cfg.hysteresis == 1``):
  if ``scale == min_scale`` (exact equality) DeepSpeed raises; here
  :class:`LossScaleUnderflowError` (unless ``raise_at_min_scale`` is off), otherwise
  ``scale = max(scale / scale_factor, min_scale)``. ``hysteresis_left`` stays at 1.
* overflow, hysteresis left: ``hysteresis_left -= 1``; the scale is kept.
* every overflow (either branch) resets ``good_steps`` to 0, so an overflow absorbed by
  hysteresis still restarts the growth window.
* no overflow: with ``consecutive_hysteresis`` ``hysteresis_left`` is refilled to
  ``cfg.hysteresis``. Then, if ``good_steps > 0 and good_steps % window == 0``, the scale is
  multiplied by ``scale_factor`` (and, without ``consecutive_hysteresis``, the hysteresis is
  refilled: the only place it is refilled in that mode). ``good_steps += 1``.
* ``step += 1`` always.

Off-by-one conventions (hand-checked): the growth test uses the count of good steps *before*
the current one, so from the start or after an overflow the first growth happens at the update
of the ``window + 1``-th consecutive good step; later growths follow every ``window`` good steps
(the count is taken modulo ``window`` and is not reset by a growth). Older DeepSpeed (e.g.
microsoft/DeepSpeed at commit 03365187, before the 2025 rework of this file) tested
``(cur_iter - last_overflow_iter) % window == 0`` instead, growing one step earlier (at the
``window``-th good step); that legacy rule is not modelled.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "LossScaleUnderflowError",
    "LossScaler",
    "ScalerConfig",
    "ScalerState",
    "describe_overflow",
    "initial_state",
    "overflow_flag",
    "update_scale",
]

_STATE_KEYS: tuple[str, ...] = ("scale", "hysteresis_left", "good_steps", "step")


class LossScaleUnderflowError(RuntimeError):
    """An overflow hit while the scale already equals ``min_scale`` (DeepSpeed exits the run); the message is one
    line naming ``fp16.min_loss_scale`` and what would help."""


@dataclass(frozen=True)
class ScalerState:
    """Loss-scaler state after ``step`` updates.

    Invariants: ``scale`` is finite and > 0; ``hysteresis_left >= 1`` (DeepSpeed's
    ``cur_hysteresis``); ``0 <= good_steps <= step``; ``good_steps`` equals DeepSpeed's
    ``cur_iter - last_overflow_iter - 1`` and, after any update, is 0 iff that update overflowed.
    """

    scale: float
    hysteresis_left: int
    good_steps: int
    step: int

    def __post_init__(self) -> None:
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"scale must be finite and > 0, got {self.scale!r}")
        if self.hysteresis_left < 1:
            raise ValueError(f"hysteresis_left must be >= 1, got {self.hysteresis_left!r}")
        if not 0 <= self.good_steps <= self.step:
            raise ValueError(f"need 0 <= good_steps <= step, got good_steps={self.good_steps!r}, step={self.step!r}")


@dataclass(frozen=True)
class ScalerConfig:
    """Loss-scaling settings, DeepSpeed ``fp16`` block semantics.

    Invariants: ``initial_scale`` finite and > 0. When ``dynamic``: ``window >= 1``,
    ``hysteresis >= 1``, ``min_scale`` finite and > 0, ``scale_factor > 1`` (the other fields are
    carried but unused by static scaling). ``raise_at_min_scale`` mirrors DeepSpeed's
    ``raise_error_at_min_scale`` (always True in its ZeRO optimizers).
    """

    dynamic: bool
    initial_scale: float
    window: int
    hysteresis: int
    consecutive_hysteresis: bool
    min_scale: float
    scale_factor: float = 2.0
    raise_at_min_scale: bool = True

    def __post_init__(self) -> None:
        if not (math.isfinite(self.initial_scale) and self.initial_scale > 0):
            raise ValueError(f"initial_scale must be finite and > 0, got {self.initial_scale!r}")
        if not self.dynamic:
            return
        if self.window < 1:
            raise ValueError(f"window must be >= 1 with dynamic scaling, got {self.window!r}")
        if self.hysteresis < 1:
            raise ValueError(f"hysteresis must be >= 1 with dynamic scaling, got {self.hysteresis!r}")
        if not (math.isfinite(self.min_scale) and self.min_scale > 0):
            raise ValueError(f"min_scale must be finite and > 0, got {self.min_scale!r}")
        if not self.scale_factor > 1:
            raise ValueError(f"scale_factor must be > 1, got {self.scale_factor!r}")

    @classmethod
    def from_fp16(
        cls,
        enabled: bool,
        loss_scale: float,
        initial_scale_power: int,
        loss_scale_window: int,
        hysteresis: int,
        consecutive_hysteresis: bool,
        min_loss_scale: float,
    ) -> ScalerConfig:
        """Map DeepSpeed's ``fp16`` keys: ``loss_scale == 0`` means dynamic from
        ``2**initial_scale_power``; a positive ``loss_scale`` is a static scale; fp16 disabled
        gives a static scale of 1.0 (DeepSpeed's no-op ``LossScaler`` for fp32/bf16).
        """
        dynamic = bool(enabled) and float(loss_scale) == 0.0
        if not enabled:
            initial = 1.0
        elif dynamic:
            initial = 2.0 ** int(initial_scale_power)
        else:
            initial = float(loss_scale)
        return cls(
            dynamic=dynamic,
            initial_scale=initial,
            window=int(loss_scale_window),
            hysteresis=int(hysteresis),
            consecutive_hysteresis=bool(consecutive_hysteresis),
            min_scale=float(min_loss_scale),
        )


def initial_state(cfg: ScalerConfig) -> ScalerState:
    """State before the first update: ``initial_scale``, full hysteresis, no steps seen."""
    return ScalerState(
        scale=float(cfg.initial_scale),
        hysteresis_left=max(1, cfg.hysteresis),
        good_steps=0,
        step=0,
    )


def _on_overflow(state: ScalerState, cfg: ScalerConfig) -> ScalerState:
    """Dynamic overflow branch: reduce the scale once hysteresis is exhausted, else spend one."""
    if cfg.hysteresis == 1 or state.hysteresis_left <= 1:
        if state.scale == cfg.min_scale and cfg.raise_at_min_scale:
            raise LossScaleUnderflowError(
                f"fp16 loss scale already at its minimum (fp16.min_loss_scale = {cfg.min_scale:g}) and the "
                f"gradients still overflow after {state.step} optimizer steps: the run has diverged or its gradients "
                "do not fit fp16; lower the learning rate, train in bf16, or set a smaller fp16.min_loss_scale"
            )
        scale = max(state.scale / cfg.scale_factor, cfg.min_scale)
        hysteresis_left = state.hysteresis_left
    else:
        scale = state.scale
        hysteresis_left = state.hysteresis_left - 1
    return ScalerState(scale, hysteresis_left, good_steps=0, step=state.step + 1)


def _on_good_step(state: ScalerState, cfg: ScalerConfig) -> ScalerState:
    """Dynamic non-overflow branch: refill hysteresis if consecutive, grow on window boundaries."""
    scale = state.scale
    hysteresis_left = cfg.hysteresis if cfg.consecutive_hysteresis else state.hysteresis_left
    if state.good_steps > 0 and state.good_steps % cfg.window == 0:
        scale = scale * cfg.scale_factor
        hysteresis_left = cfg.hysteresis
    return ScalerState(scale, hysteresis_left, state.good_steps + 1, state.step + 1)


def update_scale(state: ScalerState, overflow: bool, cfg: ScalerConfig) -> ScalerState:
    """The state after one optimizer step whose (globally reduced) overflow flag is ``overflow``.

    Pure: ``state`` is not modified. Static scaling (``cfg.dynamic`` False) never changes the
    scale or ``hysteresis_left``; it only advances ``step`` and ``good_steps`` (reset on an
    overflow), so the :class:`ScalerState` invariants hold in both modes. See the module
    docstring for the exact dynamic rule.

    Raises:
        LossScaleUnderflowError: dynamic, overflow with hysteresis exhausted while
            ``scale == cfg.min_scale`` and ``cfg.raise_at_min_scale``.
    """
    if not cfg.dynamic:
        good_steps = 0 if overflow else state.good_steps + 1
        return dataclasses.replace(state, good_steps=good_steps, step=state.step + 1)
    if overflow:
        return _on_overflow(state, cfg)
    return _on_good_step(state, cfg)


def overflow_flag(tensors: Iterable[torch.Tensor], device: torch.device | str | None = None) -> torch.Tensor:
    """0-dim float32 tensor: 1.0 if any element of any tensor is inf, -inf or nan, else 0.0.

    Exact for every floating dtype (fp16/bf16/fp32/...; a finite bf16/fp32 value near the dtype
    maximum is not mistaken for an overflow, unlike sum- or norm-based checks). Integer tensors
    never overflow. No host synchronisation (when all tensors and ``device`` share one device):
    the result stays on the device, ready for an all-reduce with MAX. It is placed on
    ``device`` if given, else on the first tensor's device, else (empty input) on the CPU; pass
    ``device`` so ranks that own no tensors still produce a flag on the communication device.
    Inputs are not modified and no autograd graph is recorded.
    """
    finite_parts: list[torch.Tensor] = []
    target = torch.device(device) if device is not None else None
    with torch.no_grad():
        for tensor in tensors:
            all_finite = torch.isfinite(tensor.detach()).all()
            if target is None:
                target = all_finite.device
            finite_parts.append(all_finite.to(target))
    if target is None:
        target = torch.device("cpu")
    if not finite_parts:
        return torch.zeros((), dtype=torch.float32, device=target)
    all_finite = torch.stack(finite_parts).all()
    return torch.logical_not(all_finite).to(torch.float32)


def _format_scale(value: float) -> str:
    """DeepSpeed prints ``int(scale)``; integral scales match that, fractional ones keep digits."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def describe_overflow(state_before: ScalerState, state_after: ScalerState, rank: int = 0) -> str:
    """The overflow log line for the transition ``state_before -> state_after``, shaped like
    DeepSpeed's (with ``[hybridzero]`` for ``[deepspeed]``), one line each::

        [hybridzero] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536,
            reducing to 32768
        [hybridzero] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536,
            but hysteresis is 2. Reducing hysteresis to 1

    The hysteresis variant is used when the update spent hysteresis; otherwise the scale line
    (a static scale reads "reducing to" the same value, like DeepSpeed's old ZeRO message).

    Raises:
        ValueError: ``state_after`` is not the result of an overflow update of ``state_before``.
    """
    if state_after.step != state_before.step + 1 or state_after.good_steps != 0:
        raise ValueError("describe_overflow needs the states before and after an overflow update")
    head = f"[hybridzero] OVERFLOW! Rank {rank} Skipping step. "
    attempted = f"Attempted loss scale: {_format_scale(state_before.scale)}"
    if state_after.hysteresis_left < state_before.hysteresis_left:
        return (
            f"{head}{attempted}, but hysteresis is {state_before.hysteresis_left}. "
            f"Reducing hysteresis to {state_after.hysteresis_left}"
        )
    return f"{head}{attempted}, reducing to {_format_scale(state_after.scale)}"


class LossScaler:
    """Stateful wrapper around :func:`update_scale` for the engine.

    ``scale`` is the factor to multiply the loss by for the next step; ``update(overflow)``
    advances the state and returns True when the step must be skipped (any overflow, static or
    dynamic, as DeepSpeed's ZeRO optimizers skip the step whenever fp16 gradients overflow).
    ``log``, if given, receives :func:`describe_overflow`'s line on every overflow (pass a
    logger's ``info`` on the logging rank only). Invariant: ``state`` is always a valid
    :class:`ScalerState`; a raising update leaves it unchanged.
    """

    def __init__(
        self,
        config: ScalerConfig,
        state: ScalerState | None = None,
        *,
        rank: int = 0,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.config: ScalerConfig = config
        self.state: ScalerState = state if state is not None else initial_state(config)
        self.rank: int = rank
        self.log: Callable[[str], None] | None = log

    @property
    def scale(self) -> float:
        """The current loss scale."""
        return self.state.scale

    @property
    def dynamic(self) -> bool:
        """Whether the scale adapts to overflows."""
        return self.config.dynamic

    def update(self, overflow: bool) -> bool:
        """Advance one step with the globally reduced overflow flag; True means skip the step."""
        overflowed = bool(overflow)
        before = self.state
        self.state = update_scale(before, overflowed, self.config)
        if overflowed and self.log is not None:
            self.log(describe_overflow(before, self.state, rank=self.rank))
        return overflowed

    def state_dict(self) -> dict[str, Any]:
        """Plain Python scalars: ``scale``, ``hysteresis_left``, ``good_steps``, ``step``."""
        return dataclasses.asdict(self.state)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the keys must match exactly and satisfy the invariants."""
        keys = set(state_dict)
        if keys != set(_STATE_KEYS):
            raise KeyError(f"loss scaler state_dict keys {sorted(keys)} != expected {sorted(_STATE_KEYS)}")
        self.state = ScalerState(
            scale=float(state_dict["scale"]),
            hysteresis_left=int(state_dict["hysteresis_left"]),
            good_steps=int(state_dict["good_steps"]),
            step=int(state_dict["step"]),
        )

    def __repr__(self) -> str:
        return f"LossScaler(dynamic={self.config.dynamic}, state={self.state})"

"""Tests for hybridzero.optim.loss_scaler: DeepSpeed's fp16 dynamic loss-scaling rule.

Sequences are hand-computed from DeepSpeed's ``DynamicLossScaler.update_scale`` as read in
deepspeedai/DeepSpeed master (commits 18fd4c97 / 68ee9f83, 2025-2026: ``stable_interval =
cur_iter - last_overflow_iter - 1``). ``_DeepSpeedOracle`` restates that rule in DeepSpeed's own
terms (iteration indices, not a good-step counter) and is compared against ``update_scale`` on
generated flag sequences.

Here: the rule itself (``update_scale``: config, growth, hysteresis, minimum scale, the oracle). Overflow
detection, the log lines and the ``LossScaler`` object are in ``test_loss_scaler_wrapper.py``.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridzero.optim.loss_scaler import (
    LossScaleUnderflowError,
    ScalerConfig,
    ScalerState,
    initial_state,
    update_scale,
)

O, G = True, False  # overflow / good step


def _cfg(
    initial: float = 16.0,
    window: int = 3,
    hysteresis: int = 2,
    consecutive: bool = False,
    min_scale: float = 1.0,
    dynamic: bool = True,
    raise_at_min: bool = True,
) -> ScalerConfig:
    return ScalerConfig(
        dynamic=dynamic,
        initial_scale=initial,
        window=window,
        hysteresis=hysteresis,
        consecutive_hysteresis=consecutive,
        min_scale=min_scale,
        raise_at_min_scale=raise_at_min,
    )


def _run(cfg: ScalerConfig, flags: list[bool]) -> list[tuple[float, int]]:
    """(scale, hysteresis_left) after each update."""
    state = initial_state(cfg)
    out: list[tuple[float, int]] = []
    for flag in flags:
        state = update_scale(state, flag, cfg)
        out.append((state.scale, state.hysteresis_left))
    return out


def _scales(cfg: ScalerConfig, flags: list[bool]) -> list[float]:
    return [scale for scale, _ in _run(cfg, flags)]


class _DeepSpeedOracle:
    """DeepSpeed's update rule in its own bookkeeping (cur_iter / last_overflow_iter)."""

    def __init__(self, cfg: ScalerConfig) -> None:
        self.cfg = cfg
        self.scale = cfg.initial_scale
        self.it = 0
        self.last_overflow = -1
        self.hyst = cfg.hysteresis

    def update(self, overflow: bool) -> None:
        c = self.cfg
        if overflow:
            if c.hysteresis == 1 or self.hyst == 1:
                if self.scale == c.min_scale:
                    raise LossScaleUnderflowError("oracle: at minimum")
                self.scale = max(self.scale / c.scale_factor, c.min_scale)
            else:
                self.hyst -= 1
            self.last_overflow = self.it
        else:
            if c.consecutive_hysteresis:
                self.hyst = c.hysteresis
            stable = self.it - self.last_overflow - 1
            if stable > 0 and stable % c.window == 0:
                if not c.consecutive_hysteresis:
                    self.hyst = c.hysteresis
                self.scale *= c.scale_factor
        self.it += 1


# --- config mapping and initial state
def test_from_fp16_dynamic_static_disabled() -> None:
    dyn = ScalerConfig.from_fp16(True, 0.0, 16, 1000, 2, False, 1.0)
    assert dyn.dynamic and dyn.initial_scale == 65536.0
    assert (dyn.window, dyn.hysteresis, dyn.consecutive_hysteresis) == (1000, 2, False)
    assert (dyn.min_scale, dyn.scale_factor, dyn.raise_at_min_scale) == (1.0, 2.0, True)
    static = ScalerConfig.from_fp16(True, 128.0, 16, 1000, 2, False, 1.0)
    assert not static.dynamic and static.initial_scale == 128.0
    off = ScalerConfig.from_fp16(False, 0.0, 16, 1000, 2, False, 1.0)
    assert not off.dynamic and off.initial_scale == 1.0


def test_initial_state() -> None:
    assert initial_state(_cfg(initial=8.0, hysteresis=3)) == ScalerState(8.0, 3, 0, 0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"window": 0},
        {"hysteresis": 0},
        {"min_scale": 0.0},
        {"min_scale": math.inf},
        {"initial": 0.0},
        {"initial": math.nan},
    ],
)
def test_config_validation(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        _cfg(**kwargs)  # type: ignore[arg-type]


def test_static_config_skips_dynamic_validation() -> None:
    assert not _cfg(dynamic=False, window=0, hysteresis=0).dynamic
    with pytest.raises(ValueError):
        _cfg(dynamic=False, initial=-1.0)


@pytest.mark.parametrize("args", [(0.0, 1, 0, 0), (math.inf, 1, 0, 0), (1.0, 0, 0, 0), (1.0, 1, 2, 1), (1.0, 1, -1, 0)])
def test_state_validation(args: tuple[float, int, int, int]) -> None:
    with pytest.raises(ValueError):
        ScalerState(*args)


# --- static scaling
def test_static_scale_never_changes() -> None:
    cfg = _cfg(initial=128.0, dynamic=False, window=1)
    state = initial_state(cfg)
    for flag in [O, O, O, G, G, G, O, G]:
        state = update_scale(state, flag, cfg)
        assert state.scale == 128.0 and state.hysteresis_left == 2
    assert (state.good_steps, state.step) == (1, 8)


# --- growth
def test_growth_first_after_window_plus_one_then_every_window() -> None:
    # stable_interval = good steps before this one: 0,1,2,3 -> grow at 3, then at 6.
    assert _scales(_cfg(window=3), [G] * 7) == [16, 16, 16, 32, 32, 32, 64]


def test_no_growth_before_window() -> None:
    cfg = _cfg(initial=4.0, window=5)
    state = initial_state(cfg)
    for _ in range(5):
        state = update_scale(state, G, cfg)
    assert state.scale == 4.0 and state.good_steps == 5
    assert update_scale(state, G, cfg).scale == 8.0


def test_window_one() -> None:
    # First good step never grows (stable_interval 0); afterwards every step does.
    assert _scales(_cfg(window=1), [G, G, G]) == [16, 32, 64]
    assert _scales(_cfg(window=1, hysteresis=1), [O, G, G, G]) == [8, 8, 16, 32]


def test_growth_count_is_modular_not_reset() -> None:
    state = initial_state(_cfg(window=2))
    for _ in range(5):
        state = update_scale(state, G, _cfg(window=2))
    assert state.scale == 64.0 and state.good_steps == 5  # grew at good_steps 2 and 4


def test_overflow_mid_window_resets_count() -> None:
    cfg = _cfg(window=3)
    #            G   G   O(absorbed)  G   G   G   G(grow)
    flags = [G, G, O, G, G, G, G]
    assert _run(cfg, flags) == [(16, 2), (16, 2), (16, 1), (16, 1), (16, 1), (16, 1), (32, 2)]
    # without the overflow the scale would have grown at the 4th update
    assert _scales(cfg, [G, G, G, G]) == [16, 16, 16, 32]


def test_default_window_sequence() -> None:
    cfg = ScalerConfig.from_fp16(True, 0.0, 16, 1000, 2, False, 1.0)
    state = initial_state(cfg)
    for flag in [O, O]:
        state = update_scale(state, flag, cfg)
    assert state.scale == 32768.0
    for _ in range(1000):
        state = update_scale(state, G, cfg)
    assert state.scale == 32768.0 and state.hysteresis_left == 1
    state = update_scale(state, G, cfg)
    assert state.scale == 65536.0 and state.hysteresis_left == 2 and state.step == 1003


# --- hysteresis
def test_hysteresis_two_first_overflow_keeps_second_reduces() -> None:
    assert _run(_cfg(), [O, O, O]) == [(16, 1), (8, 1), (4, 1)]


def test_hysteresis_one_reduces_every_overflow() -> None:
    assert _scales(_cfg(hysteresis=1), [O, O, G, O]) == [8, 4, 4, 2]


def test_hysteresis_not_restored_by_good_steps_without_consecutive() -> None:
    assert _run(_cfg(consecutive=False), [O, G, O]) == [(16, 1), (16, 1), (8, 1)]


def test_consecutive_hysteresis_restored_by_each_good_step() -> None:
    assert _run(_cfg(consecutive=True), [O, G, O, G, O]) == [(16, 1), (16, 2), (16, 1), (16, 2), (16, 1)]
    assert _run(_cfg(consecutive=True), [O, O, G]) == [(16, 1), (8, 1), (8, 2)]


def test_hysteresis_restored_at_growth_without_consecutive() -> None:
    cfg = _cfg(window=2)
    assert _run(cfg, [O, G, G, G, O]) == [(16, 1), (16, 1), (16, 1), (32, 2), (32, 1)]


def test_hysteresis_three() -> None:
    assert _run(_cfg(hysteresis=3), [O, O, O, O]) == [(16, 2), (16, 1), (8, 1), (4, 1)]


# --- min scale
def test_min_scale_floor_then_raise() -> None:
    cfg = _cfg(initial=4.0, hysteresis=1, min_scale=3.0)
    state = update_scale(initial_state(cfg), O, cfg)
    assert state.scale == 3.0  # max(4 / 2, 3)
    with pytest.raises(LossScaleUnderflowError):
        update_scale(state, O, cfg)
    assert update_scale(state, G, cfg).scale == 3.0


def test_min_scale_no_raise_stays_at_floor() -> None:
    cfg = _cfg(initial=2.0, hysteresis=1, min_scale=1.0, raise_at_min=False)
    assert _scales(cfg, [O, O, O]) == [1, 1, 1]


def test_min_scale_hysteresis_spent_before_raise() -> None:
    cfg = _cfg(initial=1.0, hysteresis=2, min_scale=1.0)
    state = update_scale(initial_state(cfg), O, cfg)  # hysteresis absorbs it, no raise
    assert (state.scale, state.hysteresis_left) == (1.0, 1)
    with pytest.raises(LossScaleUnderflowError):
        update_scale(state, O, cfg)


# --- cross-check against the DeepSpeed-formulated oracle
@settings(max_examples=300, deadline=None)
@given(
    flags=st.lists(st.booleans(), max_size=60),
    window=st.integers(1, 5),
    hysteresis=st.integers(1, 3),
    consecutive=st.booleans(),
    initial_power=st.integers(0, 6),
)
def test_matches_deepspeed_oracle(
    flags: list[bool], window: int, hysteresis: int, consecutive: bool, initial_power: int
) -> None:
    cfg = _cfg(2.0**initial_power, window, hysteresis, consecutive, min_scale=1.0)
    oracle, state = _DeepSpeedOracle(cfg), initial_state(cfg)
    for flag in flags:
        try:
            oracle.update(flag)
        except LossScaleUnderflowError:
            with pytest.raises(LossScaleUnderflowError):
                update_scale(state, flag, cfg)
            return
        state = update_scale(state, flag, cfg)
        assert (state.scale, state.hysteresis_left) == (oracle.scale, oracle.hyst)
        assert state.step == oracle.it
        assert state.good_steps == oracle.it - oracle.last_overflow - 1

"""Tests for what surrounds hybridzero.optim.loss_scaler's pure rule (``test_loss_scaler.py``): ``overflow_flag``
(non-finite values in any dtype, empty and generator inputs), ``describe_overflow`` (DeepSpeed's log lines) and the
``LossScaler`` object (skip decisions, raising at the minimum scale, its state dict).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from hybridzero.optim.loss_scaler import (
    LossScaler,
    LossScaleUnderflowError,
    ScalerConfig,
    describe_overflow,
    initial_state,
    overflow_flag,
    update_scale,
)
from tests.unit.test_loss_scaler import G, O, _cfg


# --- overflow_flag
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_overflow_flag_detects_nonfinite(bad: float, dtype: torch.dtype) -> None:
    clean = torch.ones(4, dtype=dtype)
    dirty = torch.tensor([1.0, bad, 2.0], dtype=dtype)
    flag = overflow_flag([clean, dirty])
    assert flag.dtype == torch.float32 and flag.dim() == 0 and flag.item() == 1.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_overflow_flag_finite_including_dtype_max(dtype: torch.dtype) -> None:
    big = torch.full((1024,), torch.finfo(dtype).max, dtype=dtype)
    flag = overflow_flag([torch.randn(3, 3).to(dtype), big])
    assert flag.dtype == torch.float32 and flag.item() == 0.0


def test_overflow_flag_fp16_overflowing_arithmetic() -> None:
    x = torch.tensor([60000.0], dtype=torch.float16)
    assert overflow_flag([x * 2]).item() == 1.0  # 120000 overflows fp16 to inf


def test_overflow_flag_empty_inputs() -> None:
    flag = overflow_flag([])
    assert flag.dtype == torch.float32 and flag.dim() == 0 and flag.item() == 0.0
    assert flag.device.type == "cpu"
    assert overflow_flag([torch.empty(0), torch.empty(0, 3, dtype=torch.float16)]).item() == 0.0
    assert overflow_flag(iter([]), device="cpu").item() == 0.0


def test_overflow_flag_generator_grad_and_int_inputs() -> None:
    param = torch.ones(3, requires_grad=True)
    flag = overflow_flag(t for t in [param * 1, torch.arange(5)])
    assert flag.item() == 0.0 and not flag.requires_grad
    assert overflow_flag([torch.arange(5), torch.tensor([math.nan])]).item() == 1.0


# --- describe_overflow
def test_describe_overflow_reduce() -> None:
    cfg = _cfg(initial=65536.0, hysteresis=1)
    before = initial_state(cfg)
    after = update_scale(before, O, cfg)
    assert describe_overflow(before, after) == (
        "[hybridzero] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, reducing to 32768"
    )
    assert "Rank 3 " in describe_overflow(before, after, rank=3)


def test_describe_overflow_hysteresis() -> None:
    cfg = _cfg(initial=65536.0, hysteresis=2)
    before = initial_state(cfg)
    after = update_scale(before, O, cfg)
    assert describe_overflow(before, after) == (
        "[hybridzero] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, "
        "but hysteresis is 2. Reducing hysteresis to 1"
    )


def test_describe_overflow_matches_deepspeed_log_sequence() -> None:
    # Lines from a real DeepSpeed run (deepspeedai/DeepSpeed issue #931), defaults 2**16 / h=2.
    expected = [
        "Attempted loss scale: 65536, but hysteresis is 2. Reducing hysteresis to 1",
        "Attempted loss scale: 65536, reducing to 32768",
        "Attempted loss scale: 32768, reducing to 16384",
        "Attempted loss scale: 16384, reducing to 8192",
    ]
    lines: list[str] = []
    scaler = LossScaler(ScalerConfig.from_fp16(True, 0, 16, 1000, 2, False, 1), log=lines.append)
    for _ in expected:
        assert scaler.update(True)
    prefix = "[hybridzero] OVERFLOW! Rank 0 Skipping step. "
    assert lines == [prefix + text for text in expected]


def test_describe_overflow_fractional_and_static() -> None:
    cfg = _cfg(initial=0.5, hysteresis=1, min_scale=0.0625)
    before = initial_state(cfg)
    assert describe_overflow(before, update_scale(before, O, cfg)).endswith(
        "Attempted loss scale: 0.5, reducing to 0.25"
    )
    static = _cfg(initial=128.0, dynamic=False)
    s0 = initial_state(static)
    assert describe_overflow(s0, update_scale(s0, O, static)).endswith("128, reducing to 128")


def test_describe_overflow_rejects_non_overflow_transition() -> None:
    cfg = _cfg()
    before = initial_state(cfg)
    with pytest.raises(ValueError):
        describe_overflow(before, update_scale(before, G, cfg))
    with pytest.raises(ValueError):
        describe_overflow(before, before)


# --- LossScaler wrapper
def test_scaler_update_returns_skip_and_logs_only_overflows() -> None:
    lines: list[str] = []
    scaler = LossScaler(_cfg(), rank=0, log=lines.append)
    assert scaler.scale == 16.0 and scaler.dynamic
    assert scaler.update(False) is False and lines == []
    assert scaler.update(True) is True and len(lines) == 1
    assert scaler.update(torch.tensor(1.0)) is True and scaler.scale == 8.0  # type: ignore[arg-type]


def test_static_scaler_skips_on_overflow() -> None:
    scaler = LossScaler(_cfg(initial=128.0, dynamic=False))
    assert scaler.update(True) is True and scaler.scale == 128.0
    assert scaler.update(False) is False and scaler.scale == 128.0


def test_scaler_raise_leaves_state_unchanged() -> None:
    scaler = LossScaler(_cfg(initial=1.0, hysteresis=1, min_scale=1.0))
    before = scaler.state
    with pytest.raises(LossScaleUnderflowError):
        scaler.update(True)
    assert scaler.state == before


def test_state_dict_round_trip() -> None:
    cfg = _cfg(window=2)
    flags = [O, G, G, G, O, G]
    a = LossScaler(cfg)
    for flag in flags:
        a.update(flag)
    saved = json.loads(json.dumps(a.state_dict()))  # plain, serialisable scalars
    assert saved == {"scale": 32.0, "hysteresis_left": 1, "good_steps": 1, "step": 6}
    b = LossScaler(cfg)
    b.load_state_dict(saved)
    assert b.state == a.state
    for flag in [G, G, O, O, G, G, G]:
        assert a.update(flag) == b.update(flag)
        assert a.state == b.state


def test_load_state_dict_rejects_bad_input() -> None:
    scaler = LossScaler(_cfg())
    with pytest.raises(KeyError):
        scaler.load_state_dict({"scale": 1.0})
    with pytest.raises(KeyError):
        scaler.load_state_dict({**scaler.state_dict(), "extra": 1})
    with pytest.raises(ValueError):
        scaler.load_state_dict({"scale": -1.0, "hysteresis_left": 1, "good_steps": 0, "step": 0})

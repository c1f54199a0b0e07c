"""Tests for hybridzero.optim.schedulers: DeepSpeed's warmup schedules, exactly."""

from __future__ import annotations

import logging
import math
import warnings

import pytest
import torch

from hybridzero.optim.schedulers import (
    SUPPORTED_SCHEDULERS,
    build_scheduler,
    warmup_cosine_lr_ratio,
    warmup_decay_lr,
    warmup_lr,
    warmup_lr_factor,
)

pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")


def _optimizer(lrs: tuple[float, ...] = (1.0,)) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups, lr=lrs[0])


def _engine_lrs(sched_type: str, params: dict, steps: int, lrs: tuple[float, ...] = (1.0,)) -> list[list[float]]:
    """Lrs seen by each optimizer step when driven like DeepSpeed's engine
    (optimizer.step() then scheduler.step())."""
    opt = _optimizer(lrs)
    sched = build_scheduler(sched_type, params, opt)
    seen = []
    for _ in range(steps):
        seen.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    return seen


# ----------------------------------------------------------------------------- pure functions


def test_supported_names() -> None:
    assert SUPPORTED_SCHEDULERS == ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")


def test_warmup_factor_log_and_linear() -> None:
    inv = 1.0 / math.log(10)
    assert warmup_lr_factor(0, warmup_num_steps=10, warmup_type="log") == 0.0
    assert warmup_lr_factor(1, warmup_num_steps=10, warmup_type="log") == inv * math.log(2)
    assert warmup_lr_factor(1, warmup_num_steps=10, warmup_type="log") == pytest.approx(0.30103, abs=1e-5)
    assert warmup_lr_factor(9, warmup_num_steps=10, warmup_type="log") == pytest.approx(1.0, abs=1e-15)
    assert warmup_lr_factor(10, warmup_num_steps=10, warmup_type="log") == 1.0
    assert warmup_lr_factor(0, warmup_num_steps=10, warmup_type="linear") == 0.0
    assert warmup_lr_factor(3, warmup_num_steps=10, warmup_type="linear") == 0.3
    assert warmup_lr_factor(9, warmup_num_steps=10, warmup_type="linear") == 0.9
    assert warmup_lr_factor(10, warmup_num_steps=10, warmup_type="linear") == 1.0
    assert warmup_lr_factor(10**6, warmup_num_steps=10, warmup_type="linear") == 1.0


@pytest.mark.parametrize("n", [0, 1, 2])
def test_warmup_steps_clamped_to_two(n: int) -> None:
    assert warmup_lr_factor(0, warmup_num_steps=n, warmup_type="log") == 0.0
    assert warmup_lr_factor(1, warmup_num_steps=n, warmup_type="log") == pytest.approx(1.0, abs=1e-15)
    assert warmup_lr_factor(1, warmup_num_steps=n, warmup_type="linear") == 0.5
    assert warmup_lr_factor(2, warmup_num_steps=n, warmup_type="linear") == 1.0


def test_warmup_lr_values() -> None:
    kw = {"warmup_min_lr": 0.1, "warmup_max_lr": 1.1, "warmup_num_steps": 10}
    assert warmup_lr(0, **kw, warmup_type="linear") == 0.1
    assert warmup_lr(4, **kw, warmup_type="linear") == pytest.approx(0.5, abs=1e-15)
    assert warmup_lr(10, **kw, warmup_type="linear") == pytest.approx(1.1, abs=1e-15)
    assert warmup_lr(500, **kw) == pytest.approx(1.1, abs=1e-15)
    assert warmup_lr(3, **kw) == pytest.approx(0.1 + math.log(4) / math.log(10), rel=1e-12)


def test_warmup_decay_lr_values() -> None:
    kw = {"total_num_steps": 20, "warmup_min_lr": 0.1, "warmup_max_lr": 1.1, "warmup_num_steps": 10}
    assert warmup_decay_lr(5, **kw, warmup_type="linear") == pytest.approx(0.6, abs=1e-15)
    assert warmup_decay_lr(9, **kw, warmup_type="linear") == pytest.approx(1.0, abs=1e-15)
    assert warmup_decay_lr(10, **kw, warmup_type="linear") == pytest.approx(1.1, abs=1e-15)  # warmup end
    assert warmup_decay_lr(15, **kw) == pytest.approx(0.6, abs=1e-15)
    assert warmup_decay_lr(19, **kw) == pytest.approx(0.2, abs=1e-15)
    assert warmup_decay_lr(20, **kw) == 0.1  # decay end
    assert warmup_decay_lr(35, **kw) == 0.1  # clamped at min after the end


def test_warmup_decay_equal_total_and_warmup_holds_max() -> None:
    kw = {"total_num_steps": 10, "warmup_min_lr": 0.0, "warmup_max_lr": 1.0, "warmup_num_steps": 10}
    assert warmup_decay_lr(10, **kw) == 0.0  # (10 - 10) / max(1, 0)
    assert warmup_decay_lr(9, **kw) == pytest.approx(1.0, abs=1e-15)


def test_warmup_cosine_ratio_values() -> None:
    kw = {"total_num_steps": 12, "warmup_min_ratio": 0.1, "warmup_num_steps": 4, "cos_min_ratio": 0.0}
    assert warmup_cosine_lr_ratio(0, **kw, warmup_type="linear") == pytest.approx(0.1, abs=1e-15)
    assert warmup_cosine_lr_ratio(2, **kw, warmup_type="linear") == pytest.approx(0.55, abs=1e-15)
    assert warmup_cosine_lr_ratio(3, **kw, warmup_type="linear") == pytest.approx(0.775, abs=1e-15)
    # first post-warmup iteration is already one cosine step in: s = 1, T = 8
    first = (1 + math.cos(math.pi / 8)) / 2
    assert warmup_cosine_lr_ratio(4, **kw) == pytest.approx(first, abs=1e-15)
    assert warmup_cosine_lr_ratio(7, **kw) == pytest.approx(0.5, abs=1e-15)  # s = 4 = T / 2
    assert warmup_cosine_lr_ratio(11, **kw) == 0.0  # decay end: total - 1
    # DeepSpeed 0.19 clamps the progress: past the end the ratio stays at cos_min_ratio
    assert warmup_cosine_lr_ratio(12, **kw) == 0.0 and warmup_cosine_lr_ratio(19, **kw) == 0.0
    # no cosine window (total <= warmup): the floor right after warmup
    short = dict(kw, total_num_steps=3, cos_min_ratio=0.25)
    assert warmup_cosine_lr_ratio(4, **short) == 0.25 and warmup_cosine_lr_ratio(40, **short) == 0.25
    log_kw = dict(kw, cos_min_ratio=0.0001)
    assert warmup_cosine_lr_ratio(1, **log_kw) == pytest.approx(0.1 + 0.9 * math.log(2) / math.log(4), rel=1e-12)
    assert warmup_cosine_lr_ratio(11, **log_kw) == pytest.approx(0.0001, abs=1e-15)


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda: warmup_lr_factor(-1, warmup_num_steps=5, warmup_type="log"), "got -1"),
        (lambda: warmup_lr_factor(7, warmup_num_steps=5, warmup_type="cosine"), "warmup_type='cosine'"),
        (
            lambda: warmup_decay_lr(
                7, total_num_steps=9, warmup_min_lr=0, warmup_max_lr=1, warmup_num_steps=5, warmup_type="exp"
            ),
            "warmup_type='exp'",
        ),
    ],
)
def test_pure_function_errors(call, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        call()
    assert fragment in str(info.value)


# ----------------------------------------------------------------------------- scheduler objects


def test_warmup_lr_engine_sequence_linear() -> None:
    seen = _engine_lrs(
        "WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 1.0, "warmup_num_steps": 4, "warmup_type": "linear"}, 8
    )
    # pre-start value, then iterations 0, 1, 2, ...: the first two steps both use min_lr
    assert [s[0] for s in seen] == [0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_warmup_lr_engine_sequence_log_matches_pure_function() -> None:
    params = {"warmup_min_lr": 0.01, "warmup_max_lr": 0.5, "warmup_num_steps": 6}
    seen = [s[0] for s in _engine_lrs("WarmupLR", params, 12)]
    expected = [0.01] + [warmup_lr(i, **params) for i in range(11)]
    assert seen == expected  # bitwise
    assert seen[2] == pytest.approx(0.01 + 0.49 * math.log(2) / math.log(6), rel=1e-12)


def test_warmup_lr_per_group_lists_and_default_max() -> None:
    listed = _engine_lrs(
        "WarmupLR",
        {"warmup_min_lr": [0.0, 0.1], "warmup_max_lr": [1.0, 2.1], "warmup_num_steps": 2, "warmup_type": "linear"},
        4,
        lrs=(5.0, 5.0),
    )
    assert listed == [[0.0, 0.1], [0.0, 0.1], [0.5, 1.1], [1.0, 2.1]]
    # DeepSpeed: an unset warmup_max_lr is each group's own lr
    default = _engine_lrs("WarmupLR", {"warmup_num_steps": 2, "warmup_type": "linear"}, 4, lrs=(0.2, 0.4))
    assert default[-1] == [0.2, 0.4]
    assert default[2] == [0.1, 0.2]
    # an explicit null does the same, for WarmupDecayLR too (inherited DeepSpeed code path)
    decay = _engine_lrs(
        "WarmupDecayLR",
        {"warmup_max_lr": None, "total_num_steps": 4, "warmup_num_steps": 2, "warmup_type": "linear"},
        4,
        lrs=(0.2, 0.4),
    )
    assert decay[3] == [0.2, 0.4]


def test_warmup_decay_engine_sequence_and_default_max() -> None:
    seen = _engine_lrs(
        "WarmupDecayLR", {"total_num_steps": 6, "warmup_num_steps": 2, "warmup_type": "linear"}, 10, lrs=(0.5,)
    )
    expected = [0.0, 0.0, 0.0005, 0.001, 0.00075, 0.0005, 0.00025, 0.0, 0.0, 0.0]
    assert [s[0] for s in seen] == pytest.approx(expected, abs=1e-18)


def test_warmup_cosine_engine_sequence_scales_every_group() -> None:
    params = {
        "total_num_steps": 12,
        "warmup_num_steps": 4,
        "warmup_min_ratio": 0.1,
        "cos_min_ratio": 0.0,
        "warmup_type": "linear",
    }
    seen = _engine_lrs("WarmupCosineLR", params, 14, lrs=(2.0, 4.0))
    assert seen[0] == [0.0, 0.0]  # pre-start lr is 0 for every group (DeepSpeed #7969)
    assert seen[1] == pytest.approx([0.2, 0.4], abs=1e-15)
    assert seen[4] == pytest.approx([1.55, 3.1], abs=1e-15)
    ratio = (1 + math.cos(math.pi / 8)) / 2
    assert seen[5] == pytest.approx([2.0 * ratio, 4.0 * ratio], abs=1e-15)
    assert seen[12] == [0.0, 0.0]
    for i in range(13):
        r = warmup_cosine_lr_ratio(i, **params)
        assert seen[i + 1] == [2.0 * r, 4.0 * r]


def test_get_last_lr_and_tensor_lr() -> None:
    opt = _optimizer((1.0,))
    sched = build_scheduler(
        "WarmupLR", {"warmup_min_lr": 0.5, "warmup_max_lr": 1.0, "warmup_num_steps": 2, "warmup_type": "linear"}, opt
    )
    assert sched.get_last_lr() == [0.5]
    sched.step()
    sched.step()
    assert sched.get_last_lr() == [0.75]
    assert sched.last_batch_iteration == 1
    tensor_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=torch.tensor(0.3))
    tensor_sched = build_scheduler(
        "WarmupCosineLR", {"total_num_steps": 5, "warmup_num_steps": 2, "warmup_type": "linear"}, tensor_opt
    )
    tensor_sched.step()
    tensor_sched.step()
    assert isinstance(tensor_opt.param_groups[0]["lr"], torch.Tensor)
    assert float(tensor_opt.param_groups[0]["lr"]) == pytest.approx(0.15, rel=1e-6)


@pytest.mark.parametrize(
    ("sched_type", "params"),
    [
        ("WarmupLR", {"warmup_num_steps": 5}),
        ("WarmupDecayLR", {"total_num_steps": 9, "warmup_num_steps": 3, "warmup_type": "linear"}),
        ("WarmupCosineLR", {"total_num_steps": 9, "warmup_num_steps": 3}),
    ],
)
def test_state_dict_round_trip(sched_type: str, params: dict) -> None:
    opt_a, opt_b = _optimizer((0.3, 0.6)), _optimizer((0.3, 0.6))
    sched_a = build_scheduler(sched_type, params, opt_a)
    for _ in range(4):
        sched_a.step()
    state = sched_a.state_dict()
    assert state["last_batch_iteration"] == 3
    sched_b = build_scheduler(sched_type, params, opt_b)
    sched_b.load_state_dict(state)
    assert sched_b.get_last_lr() == sched_a.get_last_lr()
    for _ in range(8):
        sched_a.step()
        sched_b.step()
        assert [g["lr"] for g in opt_a.param_groups] == [g["lr"] for g in opt_b.param_groups]
    assert sched_b.state_dict() == sched_a.state_dict()


def test_load_deepspeed_style_state() -> None:
    params = {"warmup_num_steps": 4, "warmup_type": "linear", "warmup_max_lr": 1.0}
    sched = build_scheduler("WarmupLR", params, _optimizer())
    sched.load_state_dict({"last_batch_iteration": 1})
    assert sched.get_last_lr() == [0.25]
    sched.step()
    assert sched.get_last_lr() == [0.5]
    with pytest.raises(ValueError, match="'last_batch_iteration'"):
        sched.load_state_dict({"last_epoch": 3})
    with pytest.raises(ValueError, match="got -5"):
        sched.load_state_dict({"last_batch_iteration": -5})


def test_last_batch_iteration_param_resumes_without_touching_lrs() -> None:
    params = {"warmup_num_steps": 4, "warmup_type": "linear", "warmup_max_lr": 1.0}
    opt = _optimizer((0.123,))
    sched = build_scheduler("WarmupLR", dict(params, last_batch_iteration=1), opt)
    assert opt.param_groups[0]["lr"] == 0.123  # DeepSpeed does not apply a pre-start lr here
    assert sched.last_batch_iteration == 1
    sched.step()
    assert sched.get_last_lr() == [0.5]
    fresh = _optimizer((0.123,))
    build_scheduler("WarmupLR", dict(params, last_batch_iteration=-1), fresh)
    assert fresh.param_groups[0]["lr"] == 0.0


# ----------------------------------------------------------------------------- error paths


def test_unknown_scheduler_type() -> None:
    with pytest.raises(ValueError) as info:
        build_scheduler("CyclicLR", {}, _optimizer())
    assert "'CyclicLR'" in str(info.value)
    assert "WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest" in str(info.value)


@pytest.mark.parametrize(
    ("sched_type", "params", "key", "value"),
    [
        ("WarmupLR", {"total_num_steps": 10}, "total_num_steps", 10),
        ("WarmupLR", {"warmup_min_ratio": 0.1}, "warmup_min_ratio", 0.1),
        ("WarmupDecayLR", {"total_num_steps": 10, "cos_min_ratio": 0.1}, "cos_min_ratio", 0.1),
        ("WarmupCosineLR", {"total_num_steps": 10, "warmup_max_lr": 0.1}, "warmup_max_lr", 0.1),
        ("WarmupLR", {"last_batch_iteration": -2}, "last_batch_iteration", -2),
        ("WarmupLR", {"last_batch_iteration": 1.5}, "last_batch_iteration", 1.5),
        ("WarmupLR", {"warmup_num_steps": -1}, "warmup_num_steps", -1),
        ("WarmupLR", {"warmup_num_steps": 2.5}, "warmup_num_steps", 2.5),
        ("WarmupLR", {"warmup_num_steps": True}, "warmup_num_steps", True),
        ("WarmupLR", {"warmup_type": "cosine"}, "warmup_type", "cosine"),
        ("WarmupCosineLR", {"total_num_steps": 10, "warmup_type": "exp"}, "warmup_type", "exp"),
        ("WarmupLR", {"warmup_min_lr": -0.1}, "warmup_min_lr", -0.1),
        ("WarmupLR", {"warmup_max_lr": "1e-3"}, "warmup_max_lr", "1e-3"),
        ("WarmupLR", {"warmup_max_lr": [0.1, 0.2, 0.3]}, "warmup_max_lr", [0.1, 0.2, 0.3]),
        ("WarmupDecayLR", {"total_num_steps": -3}, "total_num_steps", -3),
        ("WarmupCosineLR", {"total_num_steps": 2000, "cos_min_ratio": float("nan")}, "cos_min_ratio", float("nan")),
        ("WarmupCosineLR", {"total_num_steps": 2000, "warmup_min_ratio": [0.1]}, "warmup_min_ratio", [0.1]),
    ],
)
def test_invalid_params_name_key_and_value(sched_type: str, params: dict, key: str, value: object) -> None:
    with pytest.raises(ValueError) as info:
        build_scheduler(sched_type, params, _optimizer((0.1, 0.2)))
    message = str(info.value)
    # the config's rules name the dotted key and show the value as JSON; the cross-checks that need the
    # optimizer (per-group lists, total vs warmup steps) name the param and its (validated) value
    assert f"scheduler.params.{key}" in message or repr(key) in message
    shown = [repr(value), "true" if value is True else repr(value)]
    if isinstance(value, list):
        shown.append(repr(tuple(value)))
    assert any(text in message for text in shown) or "unknown config key" in message


@pytest.mark.parametrize("sched_type", ["WarmupDecayLR", "WarmupCosineLR"])
def test_total_shorter_than_warmup_is_logged(sched_type: str, caplog: pytest.LogCaptureFixture) -> None:
    """A short debugging run keeping the real warmup (HF Trainer's max_steps < warmup_steps): DeepSpeed 0.19 logs a
    warning and decays right after the warmup; so does this."""
    with caplog.at_level(logging.WARNING):
        sched = build_scheduler(sched_type, {"total_num_steps": 5, "warmup_num_steps": 10}, _optimizer())
    assert "total_num_steps 5 is less than warmup_num_steps 10" in caplog.text
    floor = 0.0 if sched_type == "WarmupDecayLR" else 0.0001  # the decay's end; the cosine's floor (cos_min_ratio)
    assert sched.lrs_at(11) == [pytest.approx(floor)]


@pytest.mark.parametrize("sched_type", ["WarmupDecayLR", "WarmupCosineLR"])
def test_total_num_steps_required(sched_type: str) -> None:
    with pytest.raises(ValueError, match="total_num_steps is required"):
        build_scheduler(sched_type, {}, _optimizer())


def test_construction_sets_prestart_lr_without_warnings() -> None:
    opt = _optimizer((0.7,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_scheduler("WarmupLR", {"warmup_min_lr": 0.05}, opt)
    assert opt.param_groups[0]["lr"] == 0.05

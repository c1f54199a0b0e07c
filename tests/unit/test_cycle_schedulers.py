"""DeepSpeed's OneCycle and LRRangeTest (hybridzero.optim.cycle_schedulers): values worked out by hand from the
module docstring's formulas, DeepSpeed's construction quirks (pre-start momentum, beta2 = 0.99, no momentum for SGD),
resuming, the state dict, and the config errors."""

from __future__ import annotations

import logging

import pytest
import torch

from hybridzero.config import load_config
from hybridzero.optim.cycle_schedulers import (
    CycleShape,
    OneCycleScheduler,
    RangeTestScheduler,
    one_cycle_scale,
    range_test_factor,
)
from hybridzero.optim.schedulers import build_scheduler

CYCLE = {
    "cycle_min_lr": 0.1,
    "cycle_max_lr": 1.0,
    "cycle_first_step_size": 4,
    "cycle_min_mom": 0.8,
    "cycle_max_mom": 0.9,
    "decay_step_size": 2,
    "decay_lr_rate": 0.5,
    "decay_mom_rate": 0.1,
}


def _adam(groups: int = 1) -> torch.optim.Optimizer:
    return torch.optim.AdamW([{"params": [torch.nn.Parameter(torch.ones(2))]} for _ in range(groups)], lr=0.5)


def _trace(sched: torch.optim.lr_scheduler.LRScheduler, steps: int) -> list[tuple[float, tuple[float, float]]]:
    """(lr, betas) of group 0 after construction and after each of ``steps`` steps."""
    group = sched.optimizer.param_groups[0]
    out = [(group["lr"], group.get("betas"))]
    for _ in range(steps):
        sched.optimizer.step()
        sched.step()
        out.append((group["lr"], group.get("betas")))
    return out


def test_range_test_by_hand() -> None:
    assert range_test_factor(-1, step_size=10, step_rate=0.5, staircase=False) == 1.0
    assert range_test_factor(0, step_size=10, step_rate=0.5, staircase=False) == pytest.approx(1.05)
    assert range_test_factor(8, step_size=10, step_rate=0.5, staircase=True) == 1.0
    assert range_test_factor(9, step_size=10, step_rate=0.5, staircase=True) == 1.5
    params = {"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 10, "lr_range_test_step_rate": 0.5}
    sched = build_scheduler("lrrangetest", params, _adam())
    assert isinstance(sched, RangeTestScheduler)
    lrs = [lr for lr, _ in _trace(sched, 10)]
    assert lrs[0] == 0.01 and lrs[1] == pytest.approx(0.0105) and lrs[10] == pytest.approx(0.015)


def test_one_cycle_scale_by_hand() -> None:
    shape = CycleShape(first=4, second=4, first_stairs=0, second_stairs=0)
    assert [one_cycle_scale(i, shape) for i in (-1, 0, 3, 5, 7)] == [0.0, 0.25, 1.0, 0.5, 0.0]
    stairs = CycleShape(first=4, second=4, first_stairs=2, second_stairs=2)
    assert [one_cycle_scale(i, stairs) for i in (0, 1, 3, 4, 6)] == [0.0, 0.5, 1.0, 0.5, 0.0]
    uneven = CycleShape(first=3, second=1, first_stairs=0, second_stairs=0)
    assert one_cycle_scale(2, uneven) == 1.0 and one_cycle_scale(1, uneven) == pytest.approx(2 / 3)


def test_one_cycle_lr_and_momentum_by_hand() -> None:
    sched = build_scheduler("OneCycle", CYCLE, _adam())
    assert isinstance(sched, OneCycleScheduler)
    trace = _trace(sched, 9)
    # construction: min lr, and DeepSpeed's pre-start beta1 = min_mom with beta2 replaced by 0.99
    assert trace[0] == (0.1, (0.8, 0.99))
    expected = {1: (0.325, 0.875), 4: (1.0, 0.8), 6: (0.55, 0.85), 8: (0.1, 0.9), 9: (0.1 / 1.25, 0.9 * 1.05)}
    for k, (lr, beta1) in expected.items():
        assert trace[k][0] == pytest.approx(lr) and trace[k][1] == (pytest.approx(beta1), 0.99), k
    assert sched.get_last_lr() == [trace[9][0]]


def test_one_cycle_without_decay_holds_the_cycle_end() -> None:
    sched = build_scheduler("OneCycle", {**CYCLE, "decay_step_size": 0}, _adam())
    last = _trace(sched, 12)[-1]
    assert last == (0.1, (0.9, 0.99))


def test_one_cycle_per_group_bounds_and_no_momentum_for_sgd(caplog: pytest.LogCaptureFixture) -> None:
    sched = build_scheduler("OneCycle", {**CYCLE, "cycle_min_lr": [0.1, 0.2], "cycle_max_lr": [1.0, 0.2]}, _adam(2))
    sched.optimizer.step()
    sched.step()
    assert [g["lr"] for g in sched.optimizer.param_groups] == [pytest.approx(0.325), 0.2]
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.5, momentum=0.9)
    with caplog.at_level(logging.WARNING):
        on_sgd = build_scheduler("OneCycle", CYCLE, sgd)
    sgd.step()
    on_sgd.step()
    assert "cycle_momentum is disabled" in caplog.text and "SGD" in caplog.text
    assert "betas" not in sgd.param_groups[0] and sgd.param_groups[0]["momentum"] == 0.9


def test_resuming_leaves_the_optimizer_alone_and_state_round_trips() -> None:
    opt = _adam()
    sched = build_scheduler("OneCycle", {**CYCLE, "last_batch_iteration": 4}, opt)
    assert opt.param_groups[0]["lr"] == 0.5 and opt.param_groups[0]["betas"] == (0.9, 0.999)
    opt.step()
    sched.step()  # iteration 5: half way down
    group = opt.param_groups[0]
    assert group["lr"] == pytest.approx(0.55) and group["betas"] == (pytest.approx(0.85), 0.99)
    fresh = build_scheduler("OneCycle", CYCLE, _adam())
    fresh.load_state_dict({"last_batch_iteration": 5})  # DeepSpeed's own scheduler state
    assert fresh.last_batch_iteration == 5
    fresh.optimizer.step()
    fresh.step()  # iteration 6
    assert fresh.optimizer.param_groups[0]["lr"] == pytest.approx(0.325)


@pytest.mark.parametrize(
    ("sched_type", "params", "fragment"),
    [
        ("OneCycle", {"cycle_max_lr": 1.0}, "scheduler.params.cycle_min_lr is required for OneCycle"),
        ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_first_step_size": 0}, "cycle_first_step_size"),
        ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_momentm": True}, "cycle_momentm"),
        ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_max_mom": 1.5}, "cycle_max_mom = 1.5"),
        ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_min_mom": [0.8, 1.0]}, "cycle_min_mom"),
        ("LRRangeTest", {"lr_range_test_step_size": 0}, "lr_range_test_step_size"),
        ("LRRangeTest", {"lr_range_test_staircase": "yes"}, "lr_range_test_staircase"),
    ],
)
def test_config_errors_name_the_key(sched_type: str, params: dict, fragment: str) -> None:
    block = {"type": sched_type, "params": params}
    with pytest.raises(ValueError, match=fragment):
        load_config({"train_batch_size": 1, "scheduler": block}, 1)
    with pytest.raises(ValueError, match=fragment):
        build_scheduler(sched_type, params, _adam())


def test_deepspeeds_classes_are_the_config_schedules() -> None:
    """``deepspeed.runtime.lr_schedules``' five classes, built with DeepSpeed's signatures, step as the config's
    blocks of the same type and params do."""
    from hybridzero.deepspeed_alias.tree.runtime import lr_schedules as ds

    cases = [
        (lambda o: ds.WarmupLR(o, warmup_num_steps=3), "WarmupLR", {"warmup_num_steps": 3}),
        (
            lambda o: ds.WarmupDecayLR(o, 8, warmup_num_steps=2),
            "WarmupDecayLR",
            {"total_num_steps": 8, "warmup_num_steps": 2},
        ),
        (
            lambda o: ds.WarmupCosineLR(o, 8, warmup_num_steps=2),
            "WarmupCosineLR",
            {"total_num_steps": 8, "warmup_num_steps": 2},
        ),
        (lambda o: ds.OneCycle(o, 0.1, 1.0, cycle_first_step_size=4), "OneCycle", {**CYCLE, "decay_step_size": 0}),
        (
            lambda o: ds.LRRangeTest(o, 0.01, 10, 0.5, True),
            "LRRangeTest",
            {
                "lr_range_test_min_lr": 0.01,
                "lr_range_test_step_size": 10,
                "lr_range_test_step_rate": 0.5,
                "lr_range_test_staircase": True,
            },
        ),
    ]
    for make, sched_type, params in cases:
        assert _trace(make(_adam()), 12) == _trace(build_scheduler(sched_type, params, _adam()), 12), sched_type
    assert ds.VALID_LR_SCHEDULES == ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"]
    positional = ds.OneCycle(_adam(), 0.1, 1.0, 0.5, 4, None, 0, None, 2)  # DeepSpeed's positional order
    assert _trace(positional, 10) == _trace(build_scheduler("OneCycle", {**CYCLE, "decay_mom_rate": 0.0}, _adam()), 10)


def test_step_to_an_iteration_as_deepspeed() -> None:
    """DeepSpeed's ``step(batch_iteration)`` goes to that iteration (torch's ``step(epoch)`` would land one short)."""
    sched = build_scheduler("OneCycle", CYCLE, _adam())
    sched.optimizer.step()
    sched.step(5)
    assert sched.last_batch_iteration == 5 and sched.optimizer.param_groups[0]["lr"] == pytest.approx(0.55)
    assert sched.optimizer.param_groups[0]["betas"] == (pytest.approx(0.85), 0.99)
    sched.step()
    assert sched.last_batch_iteration == 6
    warm = build_scheduler("WarmupLR", {"warmup_num_steps": 4, "warmup_type": "linear"}, _adam())
    warm.optimizer.step()
    warm.step(last_batch_iteration=2)  # the keyword of DeepSpeed's warmup classes
    assert warm.optimizer.param_groups[0]["lr"] == pytest.approx(0.25)


def test_decay_follows_deepspeeds_arithmetic_and_a_runaway_momentum_is_an_error() -> None:
    params = {**CYCLE, "cycle_second_step_size": 7, "decay_step_size": 3, "decay_mom_rate": 0.0}
    sched = build_scheduler("OneCycle", params, _adam())
    for i in range(11, 30):  # after the 4 + 7 cycle: min_lr / (1 + rate * (k / size)), k = i - 11 + 1
        assert sched.lrs_at(i) == [0.1 / (1.0 + 0.5 * ((i - 10) / 3))], i
    runaway = build_scheduler("OneCycle", {**CYCLE, "decay_mom_rate": 0.2}, _adam())
    with pytest.raises(ValueError, match=r"momentum \(beta1\) reached .*decay_mom_rate = 0.2"):
        for _ in range(40):
            runaway.optimizer.step()
            runaway.step()

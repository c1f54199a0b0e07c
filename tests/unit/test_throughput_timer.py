"""``engine.tput_timer``: DeepSpeed's throughput-timer contract (warm-up steps untimed, stop without start ignored,
per-step time reset at the optimizer step) and the engine driving it (a training forward starts a micro-step,
``step()`` ends it). No wall time is asserted: only counters and the relations between the recorded times."""

from __future__ import annotations

import pytest
import torch

from hybridzero.runtime.throughput import ThroughputTimer


def test_warm_up_is_untimed_and_stop_without_start_is_ignored() -> None:
    timer = ThroughputTimer(batch_size=42)
    timer.stop()
    assert (timer.initialized, timer.micro_step_count, timer.start_time) == (False, 0, 0)
    for micro in range(4):  # two optimizer steps of two micro-steps: the warm-up (start_step=2)
        timer.start()
        timer.stop(global_step=micro % 2 == 1)
    assert (timer.micro_step_count, timer.global_step_count) == (4, 2)
    assert (timer.start_time, timer.total_elapsed_time) == (0, 0)
    assert timer.avg_samples_per_sec() == float("-inf")


def test_timed_steps_accumulate_and_reset_per_step() -> None:
    timer = ThroughputTimer(batch_size=8, start_step=0)
    timer.start()
    timer.stop()
    first = timer.end_time - timer.start_time
    assert timer.step_elapsed_time == pytest.approx(first) and timer.total_elapsed_time == pytest.approx(first)
    timer.start()
    timer.stop(global_step=True)
    second = timer.end_time - timer.start_time
    assert timer.step_elapsed_time == 0
    assert timer.total_elapsed_time == pytest.approx(first + second)
    timer.update_epoch_count()
    assert (timer.epoch_count, timer.micro_step_count, timer.global_step_count) == (1, 0, 1)


def test_bad_arguments_name_the_value() -> None:
    with pytest.raises(ValueError, match="batch_size=0"):
        ThroughputTimer(batch_size=0)


def test_engine_drives_the_timer() -> None:
    import hybridzero

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    cfg = {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 0},
    }
    engine, *_ = hybridzero.initialize(model=model, config=cfg)
    assert engine.tput_timer.batch_size == 6
    for _ in range(6):
        loss = engine(torch.randn(3, 4)).sum()
        engine.backward(loss)
        engine.step()
    assert (engine.tput_timer.micro_step_count, engine.tput_timer.global_step_count) == (6, 3)
    engine.eval()
    with torch.no_grad():
        engine(torch.randn(3, 4))  # an evaluation forward is not a training micro-step
    engine.step()
    assert engine.tput_timer.micro_step_count == 6

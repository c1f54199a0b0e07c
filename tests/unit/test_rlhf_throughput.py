"""Hand-computed checks of the step-3 throughput report (hybridzero.rlhf.runlog.report), including the two fixes."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from hybridzero.rlhf.runlog.report import (
    ModelShape,
    Step3Timing,
    checkpoint_factor,
    element_size,
    format_step3_lines,
    megatron_flops,
    model_shape,
    step3_throughput,
)

# l=2, h=8, V=48: one forward of one 8-token sequence is
# 24*8*2*64 * (1 + 8/(6*8) + 48/(16*2*8)) = 24576 + 4096 + 4608 = 33280 FLOPs.
SHAPE = ModelShape(num_layers=2, hidden_size=8, vocab_size=48, num_params=1000)
ONE_SEQ = 33280.0


def _timing(**overrides: object) -> Step3Timing:
    base: dict[str, object] = {
        "e2e_s": 2.0,
        "generation_s": 0.5,
        "training_s": 1.0,
        "batch_size": 2,
        "prompt_len": 4,
        "answer_len": 4,
        "world_size": 2,
        "gradient_checkpointing": False,
        "dtype_bytes": 4,
    }
    base.update(overrides)
    return Step3Timing(**base)  # type: ignore[arg-type]


def test_megatron_flops_hand_value() -> None:
    assert megatron_flops(SHAPE, 1, 8, 1.0) == pytest.approx(ONE_SEQ)
    assert megatron_flops(SHAPE, 3, 8, 4.0) == pytest.approx(12 * ONE_SEQ)


def test_checkpoint_factor() -> None:
    assert checkpoint_factor(False) == 3.0
    assert checkpoint_factor(True) == 4.0
    assert checkpoint_factor(False, lora_dim=2, hidden_size=8) == pytest.approx(3.0 - (1.0 - 0.5))


def test_step3_hand_values() -> None:
    thr = step3_throughput(SHAPE, SHAPE, _timing())
    # global batch 4 sequences; e2e 2 s
    assert thr["samples_per_s"] == pytest.approx(2.0)
    assert thr["time_per_seq_s"] == pytest.approx(0.5)
    assert thr["global_batch_size"] == 4 and thr["total_seq_len"] == 8 and thr["answer_seq_len"] == 4
    gen = 4 * ONE_SEQ
    train = 2 * 3 * 4 * ONE_SEQ  # actor + critic, factor 3
    assert thr["gen_tflops"] == pytest.approx(gen / (0.5 * 2 * 1e12))
    assert thr["train_tflops"] == pytest.approx(train / (1.0 * 2 * 1e12))
    assert thr["e2e_tflops"] == pytest.approx((gen + train) / (2.0 * 2 * 1e12))
    assert thr["gen_per_token_latency_ms"] == pytest.approx(125.0)
    assert thr["gen_bandwidth_gb_s"] == pytest.approx(1000 * 4 / 0.125 / 1e9)
    assert thr["e2e_latency_s"] == 2.0 and thr["gen_latency_s"] == 0.5 and thr["train_latency_s"] == 1.0
    assert thr["actor_params_b"] == pytest.approx(1e-6)


def test_gradient_checkpointing_and_no_critic() -> None:
    thr = step3_throughput(SHAPE, None, _timing(gradient_checkpointing=True))
    assert thr["train_tflops"] == pytest.approx(4 * 4 * ONE_SEQ / (2 * 1e12))
    assert math.isnan(thr["critic_params_b"])


def test_ppo_epochs_and_generation_batches() -> None:
    thr = step3_throughput(SHAPE, SHAPE, _timing(ppo_epochs=2, generation_batches=2))
    assert thr["samples_per_s"] == pytest.approx(2.0)  # distinct generated sequences only
    assert thr["train_tflops"] == pytest.approx(2 * 3 * 8 * ONE_SEQ / (2 * 1e12))
    assert thr["gen_per_token_latency_ms"] == pytest.approx(0.5 / (2 * 4) * 1e3)


def test_sequence_parallel_counts_each_group_once() -> None:
    # world 2, s = 2: both ranks hold the same 2 sequences, so the global batch is 2, not 4; FLOPs per rank are
    # those of the 2 sequences spread over both ranks
    thr = step3_throughput(SHAPE, None, _timing(sequence_parallel=2))
    assert thr["global_batch_size"] == 2 and thr["samples_per_s"] == pytest.approx(1.0)
    assert thr["gen_tflops"] == pytest.approx(2 * ONE_SEQ / (0.5 * 2 * 1e12))
    with pytest.raises(ValueError, match="sequence_parallel"):
        _timing(sequence_parallel=0)


def test_fix_a_ptx_does_not_change_samples_per_s() -> None:
    off = step3_throughput(SHAPE, SHAPE, _timing())
    on = step3_throughput(SHAPE, SHAPE, _timing(unsup_batch_size=2))
    assert on["samples_per_s"] == off["samples_per_s"] == pytest.approx(2.0)
    assert on["time_per_seq_s"] == off["time_per_seq_s"]
    assert on["global_batch_size"] == off["global_batch_size"] == 4
    # the ptx sequences are actor work: actor trains 8 sequences, critic 4
    assert on["train_tflops"] == pytest.approx(3 * (8 + 4) * ONE_SEQ / (2 * 1e12))
    assert on["gen_tflops"] == off["gen_tflops"]


def test_fix_b_bf16_bandwidth_is_half_of_fp32() -> None:
    fp32 = step3_throughput(SHAPE, SHAPE, _timing(dtype_bytes=element_size(torch.float32)))
    bf16 = step3_throughput(SHAPE, SHAPE, _timing(dtype_bytes=element_size(torch.bfloat16)))
    assert element_size(torch.bfloat16) == 2 and element_size(torch.float16) == 2
    assert bf16["gen_bandwidth_gb_s"] == pytest.approx(fp32["gen_bandwidth_gb_s"] / 2)
    assert bf16["gen_bandwidth_gb_s"] > 0


def test_zero_time_is_nan_not_error() -> None:
    thr = step3_throughput(SHAPE, SHAPE, _timing(training_s=0.0))
    assert math.isnan(thr["train_tflops"])
    assert "nan" in format_step3_lines(1, 2, thr, {})[3]


def test_timing_validation() -> None:
    with pytest.raises(ValueError, match="world_size"):
        _timing(world_size=0)
    with pytest.raises(ValueError, match="e2e_s"):
        _timing(e2e_s=math.inf)
    with pytest.raises(ValueError, match="batch_size"):
        _timing(batch_size=-1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        _timing().e2e_s = 1.0  # type: ignore[misc]


def test_model_shape_from_configs() -> None:
    llama = SimpleNamespace(num_hidden_layers=2, hidden_size=8, vocab_size=48)
    gpt2 = SimpleNamespace(n_layer=2, n_embd=8, vocab_size=48)
    assert model_shape(llama, 1000) == SHAPE == model_shape(gpt2, 1000)
    with pytest.raises(ValueError, match="vocab_size"):
        model_shape(SimpleNamespace(n_layer=2, n_embd=8), 1000)


def test_format_lines() -> None:
    thr = step3_throughput(SHAPE, SHAPE, _timing())
    lines = format_step3_lines(3, 10, thr, {"kl": 0.01, "reward": 1.5, "actor_loss": -0.25, "other": 9.0})
    assert lines[0] == "Step: 3/10"
    assert lines[1] == (
        "End-to-End => Latency: 2.00s, TFLOPs: 0.00, Samples/sec: 2.00, Time/seq 0.50s, "
        "Batch Size: 4, Total Seq. Length: 8"
    )
    assert lines[2] == (
        "Generation => Latency: 0.50s, Per-token Latency 125.00 ms, TFLOPs: 0.00, BW: 0.00 GB/sec, "
        "Answer Seq. Length: 4"
    )
    assert lines[3] == "Training   => Latency: 1.00s, TFLOPs: 0.00"
    assert lines[4] == "Actor Model Parameters => 0.001 M, Critic Model Parameters => 0.001 M"  # tiny: in M
    assert lines[5] == "Average reward score: 1.5000 | actor loss: -0.2500 | KL: 0.0100"
    assert len(format_step3_lines(1, 1, thr, {})) == 5

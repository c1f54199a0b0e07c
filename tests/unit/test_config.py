"""Unit tests for hybridzero.config: DeepSpeed JSON -> one typed, frozen Config, key by key through ``load_config``:
defaults, key mapping and batch arithmetic. Unknown, ignored and bad keys are in ``test_config_errors.py``;
optimizer/scheduler blocks and file handling in ``test_config_sources.py`` (both share this file's helpers).
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hybridzero.config import (
    BF16Config,
    Config,
    ConfigError,
    FP16Config,
    HybridEngineConfig,
    OffloadConfig,
    ParamOffloadConfig,
    ZeroConfig,
    load_config,
    resolve_batch_sizes,
)

TBS, MICRO, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"


def load(extra: dict[str, Any], world_size: int = 1) -> Config:
    """Load ``extra`` on top of a minimal valid config (micro batch 2)."""
    return load_config({MICRO: 2, **extra}, world_size)


def error_for(config: Any, world_size: int = 1) -> str:
    with pytest.raises(ConfigError) as info:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load_config(config, world_size)
    return str(info.value)


def warned(fn: Callable[[], Any]) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    assert all(issubclass(w.category, UserWarning) for w in caught)
    return [str(w.message) for w in caught]


# ----------------------------------------------------------------------------- defaults


def test_defaults_match_deepspeed() -> None:
    cfg = load({})
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (2, 2, 1)
    assert cfg.gradient_clipping == 0.0 and cfg.steps_per_print == 10 and cfg.seed is None
    assert cfg.communication_data_type is None and cfg.gradient_predivide_factor == 1.0
    assert not (cfg.wall_clock_breakdown or cfg.prescale_gradients or cfg.skip_nonfinite_steps)
    assert cfg.gradient_allreduce_op == "mean"
    assert cfg.optimizer is None and cfg.scheduler is None
    assert cfg.zero == ZeroConfig() and cfg.fp16 == FP16Config() and cfg.bf16 == BF16Config()
    assert cfg.hybrid_engine == HybridEngineConfig()
    assert cfg.compute_dtype == torch.float32 and cfg.communication_dtype == torch.float32
    assert cfg.dp_world_size == 1


def test_zero_defaults() -> None:
    z = ZeroConfig()
    assert (z.stage, z.prefetch_bucket_size, z.param_persistence_threshold) == (0, 50_000_000, 100_000)
    assert (z.max_live_parameters, z.max_reuse_distance) == (1_000_000_000, 1_000_000_000)
    assert (z.reduce_bucket_size, z.allgather_bucket_size, z.sub_group_size) == (500_000_000,) * 2 + (10**9,)
    assert z.contiguous_gradients and z.reduce_scatter and z.overlap_comm is False
    assert z.hpz_partition_size == 1
    assert not (z.quantized_weights or z.quantized_gradients or z.quantized_nontrainable_weights)
    assert z.offload_optimizer == OffloadConfig(device="none", pin_memory=False)
    assert z.offload_param == ParamOffloadConfig(device="none", pin_memory=False)
    assert not z.gather_16bit_weights_on_model_save and not z.offload_param.enabled
    assert z.ignore_unused_parameters  # DeepSpeed's default


def test_fp16_bf16_hybrid_defaults() -> None:
    f = FP16Config()
    assert (f.enabled, f.loss_scale, f.initial_scale_power, f.loss_scale_window) == (False, 0.0, 16, 1000)
    assert (f.hysteresis, f.consecutive_hysteresis, f.min_loss_scale) == (2, False, 1.0)
    assert f.initial_loss_scale == 2.0**16 and not f.dynamic_loss_scale
    assert BF16Config().enabled is False
    h = HybridEngineConfig()
    assert (h.enabled, h.max_out_tokens, h.inference_tp_size) == (False, 512, 1)
    assert (h.release_inference_cache, h.pin_parameters, h.tp_gather_partition_size) == (False, True, 8)


@pytest.mark.parametrize("stage, expected", [(0, False), (1, False), (2, False), (3, True)])
def test_overlap_comm_effective_default_follows_stage(stage: int, expected: bool) -> None:
    assert load({"zero_optimization": {"stage": stage}}).zero.overlap_comm is expected
    assert ZeroConfig(stage=stage).overlap_comm is expected
    assert load({"zero_optimization": {"stage": stage, "overlap_comm": None}}).zero.overlap_comm is expected


def test_overlap_comm_explicit_value_wins() -> None:
    assert load({"zero_optimization": {"stage": 3, "overlap_comm": False}}).zero.overlap_comm is False
    assert load({"zero_optimization": {"stage": 1, "overlap_comm": True}}).zero.overlap_comm is True


@pytest.mark.parametrize(
    "block, expected", [({"bf16": {"enabled": True}}, torch.bfloat16), ({"fp16": {"enabled": True}}, torch.float16)]
)
def test_compute_and_communication_dtype(block: dict[str, Any], expected: torch.dtype) -> None:
    cfg = load(block)
    assert cfg.compute_dtype == cfg.communication_dtype == expected
    assert load({**block, "communication_data_type": "fp32"}).communication_dtype == torch.float32


# ----------------------------------------------------------------------------- key mapping

Z, F16, HE = "zero_optimization", "fp16", "hybrid_engine"
# (block ("" = top level), DeepSpeed key, JSON value, Config attribute path, expected typed value)
MAPPINGS: list[tuple[str, str, Any, str, Any]] = [
    (Z, "stage", 3, "zero.stage", 3),
    (Z, "stage3_prefetch_bucket_size", 1e7, "zero.prefetch_bucket_size", 10**7),
    (Z, "prefetch_bucket_size", 7, "zero.prefetch_bucket_size", 7),
    (Z, "stage3_param_persistence_threshold", 1e4, "zero.param_persistence_threshold", 10**4),
    (Z, "param_persistence_threshold", 0, "zero.param_persistence_threshold", 0),
    (Z, "stage3_max_live_parameters", 3e8, "zero.max_live_parameters", 3 * 10**8),
    (Z, "max_live_parameters", 5, "zero.max_live_parameters", 5),
    (Z, "stage3_max_reuse_distance", 2e8, "zero.max_reuse_distance", 2 * 10**8),
    (Z, "max_reuse_distance", 9, "zero.max_reuse_distance", 9),
    (Z, "reduce_bucket_size", 2e8, "zero.reduce_bucket_size", 2 * 10**8),
    (Z, "allgather_bucket_size", 3e8, "zero.allgather_bucket_size", 3 * 10**8),
    (Z, "overlap_comm", True, "zero.overlap_comm", True),
    (Z, "contiguous_gradients", False, "zero.contiguous_gradients", False),
    (Z, "reduce_scatter", False, "zero.reduce_scatter", False),
    (Z, "sub_group_size", 1e8, "zero.sub_group_size", 10**8),
    (Z, "zero_hpz_partition_size", 2, "zero.hpz_partition_size", 2),
    (Z, "zero_quantized_weights", True, "zero.quantized_weights", True),
    (Z, "zero_quantized_gradients", True, "zero.quantized_gradients", True),
    (Z, "zero_quantized_nontrainable_weights", True, "zero.quantized_nontrainable_weights", True),
    (Z, "stage3_gather_16bit_weights_on_model_save", True, "zero.gather_16bit_weights_on_model_save", True),
    (Z, "gather_16bit_weights_on_model_save", True, "zero.gather_16bit_weights_on_model_save", True),
    (Z, "stage3_gather_fp16_weights_on_model_save", True, "zero.gather_16bit_weights_on_model_save", True),
    (
        Z,
        "offload_optimizer",
        {"device": "none", "pin_memory": True},
        "zero.offload_optimizer",
        OffloadConfig("none", True),
    ),
    (
        Z,
        "offload_param",
        {"device": "none", "nvme_path": "/n"},
        "zero.offload_param",
        ParamOffloadConfig("none", False, "/n"),
    ),
    (Z, "offload_param", {"device": "NONE"}, "zero.offload_param.device", "none"),
    (Z, "offload_param", None, "zero.offload_param", ParamOffloadConfig()),
    (Z, "cpu_offload", False, "zero.offload_optimizer", OffloadConfig()),
    (Z, "cpu_offload_param", False, "zero.offload_param", ParamOffloadConfig()),
    (Z, "ignore_unused_parameters", False, "zero.ignore_unused_parameters", False),
    (Z, "zero_quantization_block_size", 64, "zero.quantization_block_size", 64),
    (Z, "zero_quantized_gradients_bits", 4, "zero.quantized_gradients_bits", 4),
    (Z, "reduce_bucket_size", "auto", "zero.reduce_bucket_size", 500_000_000),
    (Z, "stage3_prefetch_bucket_size", "auto", "zero.prefetch_bucket_size", 50_000_000),
    (Z, "stage3_param_persistence_threshold", "auto", "zero.param_persistence_threshold", 100_000),
    (F16, "enabled", True, "fp16.enabled", True),
    (F16, "loss_scale", 128, "fp16.loss_scale", 128.0),
    (F16, "initial_scale_power", 12, "fp16.initial_scale_power", 12),
    (F16, "loss_scale_window", 500, "fp16.loss_scale_window", 500),
    (F16, "hysteresis", 4, "fp16.hysteresis", 4),
    (F16, "consecutive_hysteresis", True, "fp16.consecutive_hysteresis", True),
    (F16, "min_loss_scale", 0.5, "fp16.min_loss_scale", 0.5),
    ("bf16", "enabled", True, "bf16.enabled", True),
    ("bfloat16", "enabled", True, "bf16.enabled", True),
    (HE, "enabled", True, "hybrid_engine.enabled", True),
    (HE, "max_out_tokens", 256, "hybrid_engine.max_out_tokens", 256),
    (HE, "inference_tp_size", 1, "hybrid_engine.inference_tp_size", 1),
    (HE, "release_inference_cache", True, "hybrid_engine.release_inference_cache", True),
    (HE, "pin_parameters", False, "hybrid_engine.pin_parameters", False),
    (HE, "tp_gather_partition_size", 4, "hybrid_engine.tp_gather_partition_size", 4),
    ("", "gradient_clipping", 1, "gradient_clipping", 1.0),
    ("", "gradient_clipping", "auto", "gradient_clipping", 0.0),
    ("", "communication_data_type", "bf16", "communication_data_type", "bf16"),
    ("", "communication_data_type", "FP32", "communication_data_type", "fp32"),
    ("", "communication_data_type", None, "communication_data_type", None),
    ("", "steps_per_print", 100, "steps_per_print", 100),
    ("", "wall_clock_breakdown", True, "wall_clock_breakdown", True),
    ("", "prescale_gradients", True, "prescale_gradients", True),
    ("", "gradient_predivide_factor", 2, "gradient_predivide_factor", 2.0),
    ("", "gradient_allreduce_op", "SUM", "gradient_allreduce_op", "sum"),
    ("", "gradient_allreduce_op", "mean", "gradient_allreduce_op", "mean"),
    ("", "skip_nonfinite_steps", True, "skip_nonfinite_steps", True),
    ("", "seed", 1234, "seed", 1234),
    ("", "zero_optimization", True, "zero.stage", 1),  # DeepSpeed's deprecated boolean form
]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("block, key, value, attribute, expected", MAPPINGS)
def test_key_mapping(block: str, key: str, value: Any, attribute: str, expected: Any) -> None:
    extra = {block: {key: value}} if block else {key: value}
    got = operator.attrgetter(attribute)(load(extra, world_size=4))
    assert got == expected and type(got) is type(expected)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("cpu_offload", True, OffloadConfig("cpu")),
        (
            "offload_optimizer",
            {"device": "nvme", "nvme_path": "/n", "buffer_count": 2},
            OffloadConfig("nvme", False, "/n", 2),
        ),
        ("offload_optimizer", {"device": "CPU", "pin_memory": True}, OffloadConfig("cpu", True)),
    ],
)
def test_offload_optimizer_mapping(key: str, value: Any, expected: OffloadConfig) -> None:
    got = load({Z: {"stage": 1, key: value}}, world_size=4).zero.offload_optimizer
    assert got == expected


# ----------------------------------------------------------------------------- batch arithmetic


@pytest.mark.parametrize(
    "given_, world, expected",
    [
        ((32, 4, 2), 4, (32, 4, 2)),  # all three, consistent
        ((32, 4, None), 4, (32, 4, 2)),  # derive gas
        ((32, None, 2), 4, (32, 4, 2)),  # derive micro
        ((None, 4, 2), 4, (32, 4, 2)),  # derive train_batch_size
        ((None, 4, None), 4, (16, 4, 1)),  # only micro: gas = 1
        ((32, None, None), 4, (32, 8, 1)),  # only train_batch_size: gas = 1
        ((7, None, None), 1, (7, 7, 1)),
    ],
)
def test_resolve_batch_sizes(given_: tuple[int | None, ...], world: int, expected: tuple[int, int, int]) -> None:
    assert resolve_batch_sizes(*given_, world_size=world) == expected
    as_json = {k: ("auto" if v is None else v) for k, v in zip((TBS, MICRO, GAS), given_)}
    cfg = load_config(as_json, world)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == expected


@given(st.integers(1, 64), st.integers(1, 16), st.integers(1, 32))
def test_resolve_batch_sizes_properties(micro: int, gas: int, world: int) -> None:
    tbs = micro * gas * world
    full = (tbs, micro, gas)
    assert resolve_batch_sizes(tbs, micro, gas, world) == full
    assert resolve_batch_sizes(None, micro, gas, world) == full
    assert resolve_batch_sizes(tbs, None, gas, world) == full
    assert resolve_batch_sizes(tbs, micro, None, world) == full
    assert resolve_batch_sizes(None, micro, None, world) == (micro * world, micro, 1)
    assert resolve_batch_sizes(tbs, None, None, world) == (tbs, micro * gas, 1)
    with pytest.raises(ConfigError):
        resolve_batch_sizes(tbs + 1, micro, gas, world)


@pytest.mark.parametrize(
    "given_, world, fragments",
    [
        ((32, 4, 3), 2, ["inconsistent", "train_batch_size = 32", "(4)", "(3)", "world_size (2)", "= 24"]),
        ((30, 4, None), 2, ["train_batch_size = 30", "not divisible", f"{MICRO} (4)", "world_size (2)", GAS]),
        ((30, None, 4), 2, ["train_batch_size = 30", "not divisible", f"{GAS} (4)", "world_size (2)", MICRO]),
        ((9, None, None), 2, ["train_batch_size = 9", "not divisible", "world_size (2)"]),
        ((None, None, None), 2, ["not specified", TBS, MICRO]),
        ((None, None, 4), 2, ["not specified", f"{GAS} = 4"]),
        ((0, 4, None), 2, ["train_batch_size = 0", ">= 1"]),
        ((None, -1, None), 2, [f"{MICRO} = -1", ">= 1"]),
        ((None, 4, 0), 2, [f"{GAS} = 0", ">= 1"]),
        ((None, 4, None), 0, ["world_size = 0"]),
        ((None, True, None), 1, [f"{MICRO} = true"]),
    ],
)
def test_batch_errors_name_keys_and_values(given_: tuple[Any, ...], world: int, fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(*given_, world_size=world)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_batch_errors_from_json() -> None:
    assert "inconsistent" in error_for({TBS: 8, MICRO: 3, GAS: 1}, 2)
    assert f"{MICRO} = '4'" in error_for({MICRO: "4"})
    assert f"{TBS} = 2.5" in error_for({TBS: 2.5})
    assert "not specified" in error_for({GAS: "auto", TBS: "auto", MICRO: "auto"})
    assert load_config({TBS: 16.0, MICRO: None}, 2).train_micro_batch_size_per_gpu == 8

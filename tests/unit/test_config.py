"""Unit tests for hybridzero.config: DeepSpeed JSON -> one typed, frozen Config.

Kept as one file (~550 lines after formatting): every test here checks one function, ``load_config``, key by key;
optimizer/scheduler blocks and file handling live in ``test_config_sources.py``.
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
from hybridzero.config.load import MONITOR_BLOCKS

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


# ----------------------------------------------------------------------------- unknown keys


@pytest.mark.parametrize(
    "extra, key, suggestion",
    [
        ({"train_batch_sz": 1}, "train_batch_sz", "train_batch_size"),
        (
            {"zero_optimization": {"stage3_prefetch_bucket_sz": 1}},
            "zero_optimization.stage3_prefetch_bucket_sz",
            "stage3_prefetch_bucket_size",
        ),
        ({"zero_optimization": {"offload_param": {"devce": "cpu"}}}, "zero_optimization.offload_param.devce", "device"),
        (
            {"zero_optimization": {"offload_optimizer": {"pin_mem": True}}},
            "zero_optimization.offload_optimizer.pin_mem",
            "pin_memory",
        ),
        ({"fp16": {"loss_scale_windw": 10}}, "fp16.loss_scale_windw", "loss_scale_window"),
        ({"bf16": {"enable": True}}, "bf16.enable", "enabled"),
        ({"hybrid_engine": {"max_out_token": 3}}, "hybrid_engine.max_out_token", "max_out_tokens"),
        ({"optimizer": {"type": "Adam", "param": {}}}, "optimizer.param", "params"),
        (
            {"optimizer": {"type": "Adam", "params": {"weight_decy": 0.1}}},
            "optimizer.params.weight_decy",
            "weight_decay",
        ),
        ({"scheduler": {"type": "WarmupLR", "prams": {}}}, "scheduler.prams", "params"),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_max_l": 1.0}}},
            "scheduler.params.warmup_max_l",
            "warmup_max_lr",
        ),
    ],
)
def test_unknown_key_names_dotted_key_and_nearest(extra: dict[str, Any], key: str, suggestion: str) -> None:
    message = error_for({MICRO: 1, **extra})
    assert f"unknown config key '{key}'; did you mean '{suggestion}'?" == message


def test_unknown_key_without_close_match_lists_valid_keys() -> None:
    message = error_for({MICRO: 1, "bf16": {"zzzzzz": 1}})
    assert "'bf16.zzzzzz'" in message and "enabled" in message


# ----------------------------------------------------------------------------- ignored keys warn once


IGNORED_SAMPLE = {
    "zero_allow_untested_optimizer": True,
    "activation_checkpointing": {"partition_activations": False},
    "flops_profiler": {"enabled": False},
    "tensorboard": {"enabled": False},
    "wandb": {"enabled": False},
    "csv_monitor": {"enabled": False},
    "comms_logger": {"enabled": False},
    "dump_state": False,
    "memory_breakdown": False,
    "sparse_gradients": False,
    "data_types": {"grad_accum_dtype": "fp32"},
    "amp": {"enabled": False},
    "elasticity": {"enabled": False},
    "checkpoint": {"tag_validation": "Warn"},
    "aio": {"block_size": 1048576},
    "zero_optimization": {
        "allgather_partitions": True,
        "load_from_fp32_weights": True,
        "round_robin_gradients": False,
        "stage3_module_granularity_threshold": 0,
        "log_trace_cache_warnings": False,
        "mics_shard_size": -1,
        "memory_efficient_linear": True,
        "elastic_checkpoint": False,
        "zeropp_loco_param": None,
        "offload_optimizer": {"device": "none", "fast_init": False, "ratio": 1.0},
    },
    "fp16": {"auto_cast": False, "fp16_master_weights_and_grads": False},
    "bf16": {"immediate_grad_update": False},
    "optimizer": {"type": "Adam", "legacy_fusion": False},
}


def _ignored_keys(block: dict[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for name, value in block.items():
        key = f"{prefix}.{name}" if prefix else name
        if prefix == "" and name in MONITOR_BLOCKS:  # they act (hybridzero.monitor): no "no effect" warning
            continue
        if name in {"zero_optimization", "fp16", "bf16", "optimizer", "offload_optimizer"}:
            keys += _ignored_keys({k: v for k, v in value.items() if k not in {"type", "device"}}, key)
        else:
            keys.append(key)
    return keys


def test_ignored_keys_are_accepted_and_warn_once_per_key_per_call() -> None:
    keys = _ignored_keys(IGNORED_SAMPLE)
    for _ in range(2):  # no module-level "already warned" state: the second call warns again
        messages = warned(lambda: load(IGNORED_SAMPLE))
        for key in keys:
            assert sum(f"'{key}'" in m for m in messages) == 1, key
        assert len(messages) == len(keys)


def test_clean_config_does_not_warn() -> None:
    assert warned(lambda: load({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}})) == []


@pytest.mark.parametrize(
    "extra, fragment",
    [
        ({"zero_optimization": {"stage3_gather_fp16_weights_on_model_save": True}}, "deprecated"),
        ({"zero_optimization": {"cpu_offload": False}}, "deprecated"),
        ({"bfloat16": {"enabled": True}}, "deprecated"),
        ({"zero_optimization": True}, "deprecated"),
        ({"gradient_clipping": "auto"}, "gradient_clipping = 'auto'"),
        ({"zero_optimization": {"stage": 3, "ignore_unused_parameters": False}}, "only acts at ZeRO stages 1 and 2"),
        ({"zero_optimization": {"stage": 0, "ignore_unused_parameters": False}}, "no effect at"),
        ({"zero_optimization": {"stage": 1, "zero_quantized_weights": True}}, "ZeRO-3"),
        ({"gradient_allreduce_op": "sum", "prescale_gradients": True}, "prescale_gradients = true has no effect"),
        ({"gradient_allreduce_op": "sum", "gradient_predivide_factor": 2}, "gradient_predivide_factor = 2.0 has no"),
    ],
)
def test_deprecations_and_no_effect_settings_warn(extra: dict[str, Any], fragment: str) -> None:
    messages = warned(lambda: load(extra, world_size=2))
    assert len(messages) == 1 and fragment in messages[0]


# ----------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize(
    "extra, fragments",
    [
        ({"zero_optimization": {"stage": 4}}, ["zero_optimization.stage = 4", "[0, 3]"]),
        ({"zero_optimization": {"stage": "3"}}, ["zero_optimization.stage = '3'", "integer"]),
        ({"zero_optimization": {"stage": 2.5}}, ["zero_optimization.stage = 2.5"]),
        ({"zero_optimization": {"stage": "auto"}}, ["zero_optimization.stage = 'auto'"]),
        ({"zero_optimization": {"reduce_bucket_size": -1}}, ["zero_optimization.reduce_bucket_size = -1", ">= 1"]),
        (
            {"zero_optimization": {"stage3_prefetch_bucket_size": 1.5e7 + 0.5}},
            ["zero_optimization.stage3_prefetch_bucket_size = 15000000.5"],
        ),
        (
            {"zero_optimization": {"stage3_param_persistence_threshold": -5}},
            ["zero_optimization.stage3_param_persistence_threshold = -5", ">= 0"],
        ),
        ({"zero_optimization": {"allgather_bucket_size": "5e8"}}, ["zero_optimization.allgather_bucket_size = '5e8'"]),
        ({"zero_optimization": {"overlap_comm": "yes"}}, ["zero_optimization.overlap_comm = 'yes'", "true or false"]),
        ({"zero_optimization": {"contiguous_gradients": 1}}, ["zero_optimization.contiguous_gradients = 1"]),
        (
            {"zero_optimization": {"offload_param": {"device": "gpu"}}},
            ["zero_optimization.offload_param.device = 'gpu'", "'none', 'cpu', 'nvme'"],
        ),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "nvme"}}},
            [
                "zero_optimization.offload_optimizer.device = 'nvme'",
                "needs zero_optimization.offload_optimizer.nvme_path",
            ],
        ),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
            [
                "zero_optimization.offload_optimizer.device = 'cpu'",
                "needs stage 1, 2 or 3",
                "zero_optimization.stage = 0",
            ],
        ),
        (
            {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "buffer_count": 0}}},
            ["zero_optimization.offload_optimizer.buffer_count = 0", ">= 1"],
        ),
        (
            {
                "zero_optimization": {
                    "stage": 2,
                    "offload_optimizer": {"device": "cpu"},
                    "offload_param": {"device": "CPU"},
                }
            },
            ["zero_optimization.offload_param.device = 'cpu'", "needs stage 3", "zero_optimization.stage = 2"],
        ),
        (
            {
                "zero_optimization": {
                    "stage": 3,
                    "offload_optimizer": {"device": "cpu"},
                    "offload_param": {"device": "nvme", "nvme_path": "/n"},
                }
            },
            [
                "zero_optimization.offload_param.device = 'nvme'",
                "needs zero_optimization.offload_optimizer.device 'nvme'",
                "got 'cpu'",
            ],
        ),
        (
            {"zero_optimization": {"cpu_offload_param": True}},
            ["zero_optimization.offload_param.device = 'cpu'", "needs stage 3"],
        ),
        ({"zero_optimization": {"cpu_offload": "yes"}}, ["zero_optimization.cpu_offload = 'yes'", "true or false"]),
        ({"zero_optimization": {"ignore_unused_parameters": 0}}, ["zero_optimization.ignore_unused_parameters = 0"]),
        ({"gradient_allreduce_op": "max"}, ["gradient_allreduce_op = 'max'", "'mean', 'sum'"]),
        ({"skip_nonfinite_steps": "no"}, ["skip_nonfinite_steps = 'no'", "true or false"]),
        ({"world_size": 2}, ["unknown config key 'world_size'"]),
        (
            {"zero_optimization": {"offload_optimizer": "cpu"}},
            ["zero_optimization.offload_optimizer = 'cpu'", "JSON object"],
        ),
        (
            {"zero_optimization": {"cpu_offload": True, "offload_optimizer": {"device": "cpu"}}},
            ["zero_optimization.cpu_offload", "zero_optimization.offload_optimizer"],
        ),
        (
            {"zero_optimization": {"stage3_max_live_parameters": 1, "max_live_parameters": 2}},
            ["zero_optimization.stage3_max_live_parameters", "zero_optimization.max_live_parameters"],
        ),
        ({"zero_optimization": {"zero_hpz_partition_size": 0}}, ["zero_optimization.zero_hpz_partition_size = 0"]),
        (
            {"zero_optimization": {"zero_hpz_partition_size": 3}},
            ["zero_optimization.zero_hpz_partition_size = 3", "world_size = 4", "1, 2, 4"],
        ),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, ["fp16.enabled", "bf16.enabled"]),
        ({"fp16": {"enabled": "auto"}}, ["fp16.enabled = 'auto'", "true or false"]),
        ({"fp16": {"loss_scale": -1}}, ["fp16.loss_scale = -1"]),
        ({"fp16": {"enabled": True, "loss_scale_window": 0}}, ["fp16.loss_scale_window = 0"]),
        ({"fp16": {"enabled": True, "min_loss_scale": 0}}, ["fp16.min_loss_scale = 0"]),
        ({"bf16": {"enabled": "true"}}, ["bf16.enabled = 'true'"]),
        ({"bf16": {}, "bfloat16": {}}, ["'bf16'", "'bfloat16'"]),
        ({"communication_data_type": "fp8"}, ["communication_data_type = 'fp8'", "'fp32', 'fp16', 'bf16'"]),
        ({"communication_data_type": 16}, ["communication_data_type = 16"]),
        ({"gradient_clipping": -1.0}, ["gradient_clipping = -1.0", ">= 0"]),
        ({"gradient_clipping": "1.0"}, ["gradient_clipping = '1.0'"]),
        ({"gradient_predivide_factor": 0}, ["gradient_predivide_factor = 0", "> 0"]),
        ({"steps_per_print": 0}, ["steps_per_print = 0"]),
        ({"seed": -3}, ["seed = -3"]),
        (
            {"hybrid_engine": {"inference_tp_size": 3}},
            ["hybrid_engine.inference_tp_size = 3 does not divide world_size = 4", "valid values: 1, 2, 4"],
        ),
        ({"hybrid_engine": {"inference_tp_size": 0}}, ["hybrid_engine.inference_tp_size = 0"]),
        ({"hybrid_engine": {"tp_gather_partition_size": 0}}, ["hybrid_engine.tp_gather_partition_size = 0"]),
        ({"hybrid_engine": {"max_out_tokens": 0}}, ["hybrid_engine.max_out_tokens = 0"]),
        ({"fp16": [1]}, ["fp16 = [1]", "JSON object"]),
    ],
)
def test_bad_values_name_key_and_value(extra: dict[str, Any], fragments: list[str]) -> None:
    message = error_for({MICRO: 1, **extra}, 4)
    for fragment in fragments:
        assert fragment in message, message


def test_config_error_is_value_error_with_key_and_value() -> None:
    with pytest.raises(ValueError) as info:
        load({"zero_optimization": {"stage": 4}})
    assert isinstance(info.value, ConfigError)
    assert (info.value.key, info.value.value) == ("zero_optimization.stage", 4)

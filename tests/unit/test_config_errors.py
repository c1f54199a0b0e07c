"""Unit tests for hybridzero.config, the refusals and warnings of ``load_config``: unknown keys (named with the
nearest valid one), keys accepted without effect (one warning per key and call), deprecations, and bad values
(every error names the key and the value). Defaults, key mapping and batch arithmetic are in ``test_config.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from hybridzero.config import (
    ConfigError,
)
from hybridzero.config.load import READ_ELSEWHERE
from tests.unit.test_config import MICRO, error_for, load, warned

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
        if prefix == "" and name in READ_ELSEWHERE:  # they act (monitors, checkpointing): no "no effect" warning
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

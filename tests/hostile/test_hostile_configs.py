"""Hostile DeepSpeed configs, table-driven (issue 28): every case is a ``ConfigError`` whose message names the
offending key (dotted) or file and the bad value, never a bare ``OverflowError``/``TypeError``/``RecursionError``
from deeper down; the config file read is left byte-for-byte unchanged. One case goes through
``hybridzero.initialize`` to show an absurd ``gradient_accumulation_steps`` stops there, before any engine exists.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from hybridzero.config import ConfigError, load_config
from tests.workers.hostile_ckpt import initialize_error

MICRO = {"train_micro_batch_size_per_gpu": 1}


def _with(**keys: Any) -> dict[str, Any]:
    return {**MICRO, **keys}


def _deep(n: int) -> Any:
    out: Any = []
    for _ in range(n):
        out = [out]
    return out


ADAM = {"type": "AdamW", "params": {}}
# name -> (config, substrings of the message: the dotted key and the value as shown)
CONFIG_CASES: dict[str, tuple[Any, tuple[str, ...]]] = {
    # batch arithmetic (issue 28: an absurd gradient_accumulation_steps was a bare OverflowError later)
    "gas_huge": (_with(gradient_accumulation_steps=10**30), ("gradient_accumulation_steps", "10000000000", "<=")),
    "gas_float_huge": (_with(gradient_accumulation_steps=1e30), ("gradient_accumulation_steps", "<=")),
    "gas_inf": (_with(gradient_accumulation_steps=math.inf), ("gradient_accumulation_steps = inf",)),
    "gas_nan": (_with(gradient_accumulation_steps=math.nan), ("gradient_accumulation_steps = nan",)),
    "gas_zero": (_with(gradient_accumulation_steps=0), ("gradient_accumulation_steps = 0", ">= 1")),
    "tbs_huge": ({"train_batch_size": 10**30}, ("train_batch_size", "<=")),
    "tbs_negative": ({"train_batch_size": -8}, ("train_batch_size = -8",)),
    "tbs_bool": ({"train_batch_size": True}, ("train_batch_size = true",)),
    "tbs_str": ({"train_batch_size": "8"}, ("train_batch_size = '8'",)),
    "micro_float": ({"train_micro_batch_size_per_gpu": 1.5}, ("train_micro_batch_size_per_gpu = 1.5",)),
    "micro_huge": ({"train_micro_batch_size_per_gpu": 2**40}, ("train_micro_batch_size_per_gpu", "<=")),
    "product_overflow": (
        {"train_micro_batch_size_per_gpu": 2**20, "gradient_accumulation_steps": 2**20},
        ("gradient_accumulation_steps (1048576)", "world_size (2)", "<="),
    ),
    "three_inconsistent_huge": (
        {"train_batch_size": 2**31 - 1, "train_micro_batch_size_per_gpu": 2**30, "gradient_accumulation_steps": 2},
        ("inconsistent batch sizes",),
    ),
    # blocks of the wrong type
    "zero_str": (_with(zero_optimization="3"), ("zero_optimization = '3'", "JSON object")),
    "zero_list": (_with(zero_optimization=[3]), ("zero_optimization = [3]",)),
    "optimizer_str": (_with(optimizer="adam"), ("optimizer = 'adam'",)),
    "scheduler_int": (_with(scheduler=5), ("scheduler = 5",)),
    "fp16_str": (_with(fp16="yes"), ("fp16 = 'yes'",)),
    "bf16_list": (_with(bf16=[1]), ("bf16 = [1]",)),
    "hybrid_engine_bool": (_with(hybrid_engine=True), ("hybrid_engine = true",)),
    "optimizer_params_list": (_with(optimizer={"type": "AdamW", "params": [1]}), ("optimizer.params = [1]",)),
    # values: wrong types, NaN/inf, negative, huge
    "stage_out_of_range": (_with(zero_optimization={"stage": 7}), ("zero_optimization.stage = 7", "[0, 3]")),
    "stage_str": (_with(zero_optimization={"stage": "3"}), ("zero_optimization.stage = '3'",)),
    "stage_nan": (_with(zero_optimization={"stage": math.nan}), ("zero_optimization.stage = nan",)),
    "lr_str": (_with(optimizer={**ADAM, "params": {"lr": "0.1"}}), ("optimizer.params.lr = '0.1'",)),
    "lr_nan": (_with(optimizer={**ADAM, "params": {"lr": math.nan}}), ("optimizer.params.lr = nan",)),
    "lr_negative": (_with(optimizer={**ADAM, "params": {"lr": -1.0}}), ("optimizer.params.lr = -1.0",)),
    "betas_length": (_with(optimizer={**ADAM, "params": {"betas": [0.9]}}), ("optimizer.params.betas = [0.9]",)),
    "eps_negative": (_with(optimizer={**ADAM, "params": {"eps": -1e-8}}), ("optimizer.params.eps = -1e-08",)),
    "optimizer_type_int": (_with(optimizer={"type": 5}), ("optimizer.type = 5",)),
    "warmup_steps_huge": (
        _with(scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 10**30}}),
        ("scheduler.params.warmup_num_steps", "2**63"),
    ),
    "warmup_lr_nan": (
        _with(scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": math.nan}}),
        ("scheduler.params.warmup_max_lr = nan",),
    ),
    "scale_power_huge": (
        _with(fp16={"enabled": True, "initial_scale_power": 10000}),
        ("fp16.initial_scale_power = 10000", "[0, 64]"),
    ),
    "loss_scale_negative": (_with(fp16={"enabled": True, "loss_scale": -1}), ("fp16.loss_scale = -1",)),
    "fp16_enabled_str": (_with(fp16={"enabled": "true"}), ("fp16.enabled = 'true'",)),
    "clip_inf": (_with(gradient_clipping=math.inf), ("gradient_clipping = inf",)),
    "clip_negative": (_with(gradient_clipping=-1.0), ("gradient_clipping = -1.0",)),
    "bucket_huge": (
        _with(zero_optimization={"stage": 3, "reduce_bucket_size": 10**40}),
        ("zero_optimization.reduce_bucket_size", "2**63"),
    ),
    "hpz_negative": (
        _with(zero_optimization={"stage": 3, "zero_hpz_partition_size": -2}),
        ("zero_optimization.zero_hpz_partition_size = -2",),
    ),
    "max_out_tokens_str": (
        _with(hybrid_engine={"enabled": True, "max_out_tokens": "512"}),
        ("hybrid_engine.max_out_tokens = '512'",),
    ),
    # keys: unicode look-alikes, non-string, nested junk, deep nesting
    "cyrillic_batch_key": (
        {"tr\u0430in_batch_size": 8},
        ("unknown config key 'tr\u0430in_batch_size'", "train_batch_size"),
    ),
    "cyrillic_nested_key": (_with(zero_optimization={"st\u0430ge": 3}), ("zero_optimization.st\u0430ge", "'stage'")),
    "emoji_key": (_with(**{"\U0001f525": 1}), ("unknown config key '\U0001f525'",)),
    "int_key": ({**MICRO, "zero_optimization": {3: 3}}, ("zero_optimization has a non-string key 3",)),
    "none_key_nested": (
        _with(zero_optimization={"offload_optimizer": {None: 1}}),
        ("zero_optimization.offload_optimizer has a non-string key None",),
    ),
    "int_key_top": ({**MICRO, 5: 1}, ("non-string key 5",)),
    "tuple_key_params": (
        _with(optimizer={"type": "AdamW", "params": {(1, 2): 1}}),
        ("optimizer.params has a non-string key (1, 2)",),
    ),
    "nested_junk": (
        _with(zero_optimization={"offload_optimizer": {"device": {"x": [1, {"y": None}]}}}),
        ("zero_optimization.offload_optimizer.device",),
    ),
    "deep_nesting": (_with(zero_optimization=_deep(500)), ("zero_optimization", "JSON object")),
    "world_size_key": (_with(world_size=4), ("unknown config key 'world_size'",)),
}


@pytest.mark.parametrize("name", sorted(CONFIG_CASES))
def test_hostile_config_value(name: str) -> None:
    config, needles = CONFIG_CASES[name]
    snapshot = repr(config)
    with pytest.raises(ConfigError) as info:
        load_config(config, world_size=2)
    assert all(n in str(info.value) for n in needles), (needles, str(info.value))
    assert repr(config) == snapshot  # the caller's mapping is not modified


FILE = "{file}"  # stands for the config file's path in a message
FILE_CASES: dict[str, tuple[bytes | None, tuple[str, ...]]] = {
    "missing": (None, (FILE, "does not exist")),
    "not_json": (b"{train_batch_size: 8}", (FILE, "is not valid JSON")),
    "duplicate_key": (b'{"train_batch_size": 8, "train_batch_size": 16}', (FILE, "train_batch_size", "JSON")),
    "top_level_list": (b"[1, 2]", (FILE, "must hold a JSON object", "list")),
    "not_utf8": (b'{"train_batch_size": "\xff\xfe"}', (FILE, "cannot be read")),
    "nan_literal": (b'{"train_micro_batch_size_per_gpu": 1, "gradient_clipping": NaN}', ("gradient_clipping = nan",)),
    "deep_nesting": (b"[" * 100_000 + b"]" * 100_000, (FILE, "is not valid JSON", "RecursionError")),
    "empty": (b"", (FILE, "is not valid JSON")),
}


@pytest.mark.parametrize("name", sorted(FILE_CASES))
def test_hostile_config_file(tmp_path: Path, name: str) -> None:
    data, needles = FILE_CASES[name]
    file = tmp_path / "ds_config.json"
    if data is not None:
        file.write_bytes(data)
    with pytest.raises(ConfigError) as info:
        load_config(file, world_size=2)
    message = str(info.value)
    assert all(n.replace(FILE, str(file)) in message for n in needles), (needles, message)
    assert (file.read_bytes() if data is not None else None) == data


def test_absurd_accumulation_stops_initialize_with_a_config_error(world) -> None:
    """Issue 28: ``gradient_accumulation_steps = 10**30`` reached the engine and ended in a bare OverflowError."""
    out = world(1).run(initialize_error, {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 10**30})
    assert out[0].startswith("ConfigError: gradient_accumulation_steps = 1000000000000000000000000000000"), out

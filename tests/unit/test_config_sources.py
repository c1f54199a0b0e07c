"""Config: optimizer and scheduler blocks, JSON files, immutability and direct construction (split from
``test_config.py``: defaults, key mapping, batch arithmetic; ``test_config_errors.py``: unknown/ignored/bad keys)."""

from __future__ import annotations

import copy
import json
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from hybridzero.config import (
    BF16Config,
    Config,
    ConfigError,
    FP16Config,
    OffloadConfig,
    OptimizerConfig,
    SchedulerConfig,
    ZeroConfig,
    load_config,
)
from tests.unit.test_config import GAS, MICRO, TBS, error_for, load

# ----------------------------------------------------------------------------- optimizer / scheduler


def test_optimizer_type_is_canonicalised_and_params_read_only() -> None:
    cfg = load({"optimizer": {"type": "adamw", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0}}})
    opt = cfg.optimizer
    assert opt is not None and opt.type == "AdamW"
    assert dict(opt.params) == {"lr": 1e-4, "betas": (0.9, 0.95), "weight_decay": 0.0}
    with pytest.raises(TypeError):
        opt.params["lr"] = 1.0  # type: ignore[index]
    assert opt.resolved_params()["eps"] == 1e-8 and opt.decoupled_weight_decay
    assert OptimizerConfig("SGD", {"lr": 0.1}).type == "SGD"


@pytest.mark.parametrize(
    "type_, params, decoupled, weight_decay",
    [
        ("Adam", {}, True, 0.0),  # DeepSpeed: "Adam" runs AdamW logic unless adam_w_mode is false
        ("Adam", {"adam_w_mode": False}, False, 0.0),
        ("AdamW", {"adam_w_mode": False}, True, 0.0),
        ("AdamW", {"torch_adam": True}, True, 0.01),  # torch.optim.AdamW default
        ("SGD", {}, False, 0.0),
    ],
)
def test_optimizer_effective_defaults(type_: str, params: dict[str, Any], decoupled: bool, weight_decay: float) -> None:
    opt = OptimizerConfig(type_, params)
    assert opt.decoupled_weight_decay is decoupled
    assert opt.resolved_params()["weight_decay"] == weight_decay and opt.resolved_params()["lr"] == 1e-3


@pytest.mark.parametrize(
    "block, fragments",
    [
        ({"type": "Adamax"}, ["optimizer.type = 'Adamax'", "Adam, AdamW, SGD"]),
        ({"type": "OneBitAdam"}, ["optimizer.type = 'OneBitAdam'", "Adam, AdamW, SGD"]),
        ({"params": {}}, ["optimizer.type is required", "Adam, AdamW, SGD"]),
        ({"type": "Adam", "params": {"lr": "auto"}}, ["optimizer.params.lr = 'auto'", "set optimizer.params.lr"]),
        ({"type": "Adam", "params": {"betas": "auto"}}, ["optimizer.params.betas = 'auto'"]),
        ({"type": "Adam", "params": {"eps": "auto"}}, ["optimizer.params.eps = 'auto'"]),
        ({"type": "Adam", "params": {"weight_decay": "auto"}}, ["optimizer.params.weight_decay = 'auto'"]),
        ({"type": "Adam", "params": {"betas": [0.9]}}, ["optimizer.params.betas = [0.9]"]),
        ({"type": "Adam", "params": {"betas": [0.9, 1.0]}}, ["optimizer.params.betas = [0.9, 1.0]"]),
        ({"type": "Adam", "params": {"lr": -1}}, ["optimizer.params.lr = -1"]),
        ({"type": "Adam", "params": {"momentum": 0.9}}, ["unknown config key 'optimizer.params.momentum'"]),
        ({"type": "SGD", "params": {"betas": [0.9, 0.9]}}, ["unknown config key 'optimizer.params.betas'"]),
        (
            {"type": "Adam", "params": {"max_grad_norm": 1.0}},
            ["optimizer.params.max_grad_norm = 1.0", "gradient_clipping"],
        ),
        ({"type": "SGD", "params": {"nesterov": True}}, ["optimizer.params.nesterov", "momentum"]),
        ({"type": 3}, ["optimizer.type = 3"]),
    ],
)
def test_bad_optimizer(block: dict[str, Any], fragments: list[str]) -> None:
    message = error_for({MICRO: 1, "optimizer": block})
    for fragment in fragments:
        assert fragment in message, message


def test_scheduler_types_and_params() -> None:
    cfg = load({"scheduler": {"type": "warmupdecaylr", "params": {"total_num_steps": 10, "warmup_max_lr": 1e-3}}})
    assert cfg.scheduler == SchedulerConfig("WarmupDecayLR", {"total_num_steps": 10, "warmup_max_lr": 1e-3})
    assert cfg.scheduler.resolved_params()["warmup_type"] == "log"
    assert SchedulerConfig("WarmupLR").resolved_params()["warmup_num_steps"] == 1000
    assert SchedulerConfig("WarmupLR").resolved_params()["warmup_max_lr"] is None  # None = the optimizer's lr
    per_group = SchedulerConfig("WarmupLR", {"warmup_min_lr": [0, 1e-5], "warmup_max_lr": None})
    assert per_group.params == {"warmup_min_lr": (0.0, 1e-5), "warmup_max_lr": None}
    cosine = SchedulerConfig("WarmupCosineLR", {"total_num_steps": 5, "cos_min_ratio": 0.1, "warmup_type": "Linear"})
    assert cosine.params["warmup_type"] == "linear" and cosine.resolved_params()["warmup_min_ratio"] == 0.0


@pytest.mark.parametrize(
    "block, fragments",
    [
        ({"type": "CyclicLR"}, ["scheduler.type = 'CyclicLR'", "WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle"]),
        ({"type": "WarmupDecayLR", "params": {}}, ["scheduler.params.total_num_steps is required", "WarmupDecayLR"]),
        (
            {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_max_lr": 1.0}},
            ["unknown config key 'scheduler.params.warmup_max_lr'"],
        ),
        ({"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}, ["scheduler.params.warmup_max_lr = 'auto'"]),
        (
            {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}},
            ["scheduler.params.total_num_steps = 'auto'"],
        ),
        ({"type": "WarmupLR", "params": {"warmup_type": "cubic"}}, ["scheduler.params.warmup_type = 'cubic'"]),
        ({"type": "WarmupLR", "params": {"warmup_num_steps": -1}}, ["scheduler.params.warmup_num_steps = -1"]),
        ({"type": "WarmupLR", "params": {"warmup_min_lr": [0.1, -1]}}, ["scheduler.params.warmup_min_lr = [0.1, -1]"]),
        ({"type": "WarmupLR", "params": {"warmup_min_lr": []}}, ["scheduler.params.warmup_min_lr = []"]),
        (
            {"type": "WarmupCosineLR", "params": {"total_num_steps": 9, "cos_min_ratio": 2}},
            ["scheduler.params.cos_min_ratio = 2"],
        ),
    ],
)
def test_bad_scheduler(block: dict[str, Any], fragments: list[str]) -> None:
    message = error_for({MICRO: 1, "scheduler": block})
    for fragment in fragments:
        assert fragment in message, message


# ----------------------------------------------------------------------------- files, immutability, direct use


def test_load_from_json_file(tmp_path: Path) -> None:
    document = {TBS: 16, GAS: 2, "zero_optimization": {"stage": 3, "reduce_bucket_size": 5e7}, "bf16": {}}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(document))
    for source in (path, str(path)):
        cfg = load_config(source, 2)
        assert (cfg.train_micro_batch_size_per_gpu, cfg.zero.reduce_bucket_size) == (4, 50_000_000)
        assert cfg.raw_dict() == document


@pytest.mark.parametrize(
    "content, fragment",
    [
        (None, "does not exist"),
        ("{not json", "not valid JSON"),
        ('{"seed": 1, "seed": 2}', "duplicate key 'seed'"),
        ("[1, 2]", "must hold a JSON object"),
    ],
)
def test_bad_json_file_names_the_path(tmp_path: Path, content: str | None, fragment: str) -> None:
    path = tmp_path / "cfg.json"
    if content is not None:
        path.write_text(content)
    message = error_for(str(path))
    assert str(path) in message and fragment in message


def test_config_is_frozen_and_raw_is_a_read_only_copy() -> None:
    source = {MICRO: 2, "zero_optimization": {"stage": 2}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    snapshot = copy.deepcopy(source)
    cfg = load_config(source, 1)
    assert source == snapshot  # input not mutated
    with pytest.raises(ValidationError, match="frozen"):
        cfg.zero.stage = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.raw["zero_optimization"]["stage"] = 3  # type: ignore[index]
    source["zero_optimization"]["stage"] = 3
    assert cfg.raw["zero_optimization"]["stage"] == 2
    assert json.loads(json.dumps(cfg.raw_dict())) == snapshot


def test_pickle_and_deepcopy_round_trip() -> None:
    cfg = load({"optimizer": {"type": "Adam", "params": {"betas": [0.8, 0.9]}}, "scheduler": {"type": "WarmupLR"}})
    for clone in (pickle.loads(pickle.dumps(cfg)), copy.deepcopy(cfg)):
        assert clone == cfg and clone.raw == cfg.raw and clone.optimizer.params["betas"] == (0.8, 0.9)


def test_direct_construction_enforces_invariants() -> None:
    assert Config(8, 4, 2).dp_world_size == 1
    assert Config(8, 2, 1, world_size=4).train_batch_size == 8
    assert "inconsistent" in _raises(lambda: Config(8, 4, 1))
    assert "zero_optimization.stage = 5" in _raises(lambda: ZeroConfig(stage=5))
    assert "offload.device = 'disk'" in _raises(lambda: OffloadConfig(device="disk"))
    assert OffloadConfig(device="cpu").device == "cpu"  # offload acts (ZeRO-Offload): cpu is a valid device
    assert "bf16.enabled" in _raises(lambda: Config(1, 1, 1, fp16=FP16Config(True), bf16=BF16Config(True)))
    assert "world_size = 0" in _raises(lambda: Config(1, 1, 1, world_size=0))
    assert "zero_optimization = 5 is invalid: expected a JSON object" in _raises(lambda: Config(1, 1, 1, zero=5))
    assert Config(1, 1, 1, zero={"stage": 3}).zero == ZeroConfig(stage=3)  # a mapping is validated like JSON
    assert "zero_optimization.stage = 9" in _raises(lambda: Config(1, 1, 1, zero={"stage": 9}))
    assert ZeroConfig(**{**ZeroConfig().model_dump(), "stage": 3}).stage == 3


def _raises(fn: Callable[[], Any]) -> str:
    with pytest.raises(ConfigError) as info:
        fn()
    return str(info.value)


def test_load_config_rejects_other_sources() -> None:
    assert "mapping or a path" in error_for(42)
    assert "not list" in error_for([1])

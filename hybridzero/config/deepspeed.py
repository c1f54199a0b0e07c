"""Translate DeepSpeed JSON (a mapping or a path to a ``.json`` file) into :class:`Config`.

Semantics follow DeepSpeed (``runtime/config.py`` and its pydantic models):
batch arithmetic, ``"auto"`` for sizes meaning the default, the legacy
``bfloat16`` / ``cpu_offload`` / ``stage3_gather_fp16_weights_on_model_save``
spellings, ``overlap_comm`` defaulting to ``stage == 3``, duplicate JSON keys
rejected. Stricter than DeepSpeed: unknown keys are errors (with the nearest
valid key), wrong types are never coerced from strings, and keys DeepSpeed knows
but hybridzero ignores warn once each per call.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .batch import BATCH_KEYS, resolve_batch_sizes
from .blocks import Diagnostics, as_mapping, check_keys, known_keys, take_fields
from .errors import ConfigError, join_key, show
from .keys import (
    BF16_IGNORED,
    FP16_IGNORED,
    OFFLOAD_OPTIMIZER_IGNORED,
    OFFLOAD_PARAM_IGNORED,
    OPTIMIZER_IGNORED,
    TOP_IGNORED,
    ZERO_IGNORED,
)
from .optim import OPTIMIZER_TYPES, SCHEDULER_TYPES
from .schema import (
    BF16Config,
    Config,
    FP16Config,
    HybridEngineConfig,
    OffloadConfig,
    OptimizerConfig,
    SchedulerConfig,
    ZeroConfig,
)
from .validate import advisories
from .values import Spec, coerce, is_auto

__all__ = ["load_config", "read_json", "translate"]

_BLOCKS: frozenset[str] = frozenset(
    {"zero_optimization", "fp16", "bf16", "bfloat16", "optimizer", "scheduler", "hybrid_engine"}
)
_TOP_KNOWN: frozenset[str] = known_keys(Config) | frozenset(BATCH_KEYS) | _BLOCKS
# (new key, deprecated boolean that turns it on with device "cpu"), as DeepSpeed's ZeRO model
_OFFLOADS: tuple[tuple[str, str, frozenset[str]], ...] = (
    ("offload_optimizer", "cpu_offload", OFFLOAD_OPTIMIZER_IGNORED),
    ("offload_param", "cpu_offload_param", OFFLOAD_PARAM_IGNORED),
)
_ZERO_KNOWN: frozenset[str] = known_keys(ZeroConfig) | {name for pair in _OFFLOADS for name in pair[:2]}


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for name, value in pairs:
        if name in seen:
            raise ValueError(f"duplicate key '{name}'")
        seen[name] = value
    return seen


def read_json(path: str | os.PathLike[str]) -> Mapping[str, Any]:
    """Parse the JSON object in ``path``; ConfigError naming the path if that fails.

    Duplicate keys are rejected (as DeepSpeed does) rather than last-one-wins.
    """
    shown = os.fspath(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file '{shown}' does not exist", value=shown) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file '{shown}' cannot be read: {exc}", value=shown) from None
    try:
        data = json.loads(text, object_pairs_hook=_reject_duplicates)
    except ValueError as exc:  # json.JSONDecodeError is a ValueError, as is our duplicate-key error
        raise ConfigError(f"config file '{shown}' is not valid JSON: {exc}", value=shown) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file '{shown}' must hold a JSON object, not {type(data).__name__}", value=shown
        )
    return data


def _batch_value(root: Mapping[str, Any], key: str) -> int | None:
    value = root.get(key)
    if value is None or is_auto(value):
        return None
    return coerce(value, Spec(key, "int", minimum=1), key)


def _simple_block(cls: type, value: Any, path: str, ignored: frozenset[str], diag: Diagnostics) -> Any:
    """``cls`` from a flat block of spec-carrying keys (``null``/absent -> defaults)."""
    if value is None:
        return cls()
    block = as_mapping(value, path)
    check_keys(block, path, known_keys(cls), ignored, diag)
    return cls(**take_fields(cls, block, path, diag))


def _bf16(root: Mapping[str, Any], diag: Diagnostics) -> BF16Config:
    if "bf16" in root and "bfloat16" in root:
        raise ConfigError("'bf16' and 'bfloat16' are both set; give only 'bf16' ('bfloat16' is its old name)",
                          key="bfloat16")
    path = "bfloat16" if "bfloat16" in root else "bf16"
    if path == "bfloat16":
        diag.note(path, "config key 'bfloat16' is deprecated; use 'bf16'")
    return _simple_block(BF16Config, root.get(path), path, BF16_IGNORED, diag)


def _offload(block: Mapping[str, Any], name: str, legacy: str, ignored: frozenset[str],
             diag: Diagnostics) -> OffloadConfig:
    """One ZeRO offload block, or its deprecated boolean spelling ``legacy``."""
    path, zero = join_key("zero_optimization", name), "zero_optimization"
    if legacy in block:
        legacy_key = join_key(zero, legacy)
        if name in block:
            raise ConfigError(f"'{legacy_key}' (deprecated) and '{path}' are both set; give only '{path}'",
                              key=legacy_key)
        on = coerce(block[legacy], Spec(legacy, "bool"), legacy_key)
        diag.note(legacy_key, f"config key '{legacy_key}' is deprecated; use '{path}': {{\"device\": \"cpu\"}}")
        return OffloadConfig(device="cpu" if on else "none")
    if block.get(name) is None:
        return OffloadConfig()
    sub = as_mapping(block[name], path)
    check_keys(sub, path, known_keys(OffloadConfig), ignored, diag)
    config = OffloadConfig(**take_fields(OffloadConfig, sub, path, diag))
    if config.device == "nvme" and not config.nvme_path:
        raise ConfigError(f"{path}.device = 'nvme' needs {path}.nvme_path (a directory on the NVMe device)",
                          key=join_key(path, "nvme_path"))
    return config


def _zero(value: Any, diag: Diagnostics) -> ZeroConfig:
    path = "zero_optimization"
    if value is None:
        return ZeroConfig()
    if isinstance(value, bool):  # DeepSpeed's deprecated form: true means stage 1
        diag.note(path, f"{path} = {show(value)} is deprecated; use {{\"stage\": {int(value)}}}")
        return ZeroConfig(stage=1 if value else 0)
    block = as_mapping(value, path)
    check_keys(block, path, _ZERO_KNOWN, ZERO_IGNORED, diag)
    kwargs = take_fields(ZeroConfig, block, path, diag)
    for name, legacy, ignored in _OFFLOADS:
        kwargs[name] = _offload(block, name, legacy, ignored, diag)
    return ZeroConfig(**kwargs)


def _typed_block(cls: type, value: Any, path: str, supported: tuple[str, ...],
                 ignored: frozenset[str], diag: Diagnostics) -> Any:
    """An optimizer/scheduler block: ``{"type": ..., "params": {...}}`` or null."""
    if value is None:
        return None
    block = as_mapping(value, path)
    check_keys(block, path, frozenset({"type", "params"}), ignored, diag)
    if block.get("type") is None:
        key = join_key(path, "type")
        raise ConfigError(f"{key} is required in '{path}'; supported: {', '.join(supported)}", key=key)
    params = block.get("params")
    return cls(type=block["type"], params={} if params is None else params)


def translate(raw: Mapping[str, Any], world_size: int, diag: Diagnostics) -> Config:
    """Build the :class:`Config` for ``raw`` at data-parallel ``world_size``.

    Pure apart from recording warnings in ``diag``. Raises ConfigError on the
    first invalid key or value.
    """
    root = as_mapping(raw, "config")
    check_keys(root, "", _TOP_KNOWN, TOP_IGNORED, diag)
    tbs, micro, gas = resolve_batch_sizes(*(_batch_value(root, key) for key in BATCH_KEYS), world_size)
    config = Config(
        train_batch_size=tbs,
        train_micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=gas,
        zero=_zero(root.get("zero_optimization"), diag),
        fp16=_simple_block(FP16Config, root.get("fp16"), "fp16", FP16_IGNORED, diag),
        bf16=_bf16(root, diag),
        optimizer=_typed_block(OptimizerConfig, root.get("optimizer"), "optimizer", OPTIMIZER_TYPES,
                               OPTIMIZER_IGNORED, diag),
        scheduler=_typed_block(SchedulerConfig, root.get("scheduler"), "scheduler", SCHEDULER_TYPES,
                               frozenset(), diag),
        hybrid_engine=_simple_block(HybridEngineConfig, root.get("hybrid_engine"), "hybrid_engine",
                                    frozenset(), diag),
        raw=root,
        world_size=world_size,
        **take_fields(Config, root, "", diag),
    )
    for key, message in advisories(config):
        diag.note(key, message)
    return config


def load_config(config: Mapping[str, Any] | str | os.PathLike[str], world_size: int) -> Config:
    """Load DeepSpeed JSON -- a mapping, or a path to a ``.json`` file -- as a :class:`Config`.

    ``world_size`` is the data-parallel world size the batch sizes are resolved
    against. Raises ConfigError naming the key (or file) on any invalid input.
    Keys DeepSpeed accepts but hybridzero ignores, deprecated spellings, and
    settings with no effect each produce one ``UserWarning`` per call.
    """
    if isinstance(config, (str, os.PathLike)):
        raw = read_json(config)
    elif isinstance(config, Mapping):
        raw = config
    else:
        raise ConfigError(
            f"config must be a mapping or a path to a JSON file, not {type(config).__name__}", value=config
        )
    diag = Diagnostics()
    result = translate(raw, world_size, diag)
    diag.emit(stacklevel=2)
    return result

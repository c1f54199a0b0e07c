"""Load DeepSpeed JSON (a mapping or a path to a ``.json`` file) as a :class:`Config`, and say what has no effect.

Semantics follow DeepSpeed: batch arithmetic, ``"auto"`` for sizes meaning the default, the legacy ``bfloat16`` /
``cpu_offload`` / ``stage3_gather_fp16_weights_on_model_save`` spellings, ``overlap_comm`` defaulting to
``stage == 3``, duplicate JSON keys rejected. Stricter than DeepSpeed: unknown keys are errors (with the nearest
valid key), values are never coerced from strings, ``offload_param`` acts only with stage 3 and an offloaded
optimizer, and every key accepted without effect warns once per call, by name (:func:`notes` walks the JSON against
the models).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from .base import Block, child_model, spellings, to_config_error
from .errors import ConfigError, join_key, show, unknown_key_error
from .optim import OPTIMIZER_PARAMS, SCHEDULER_PARAMS
from .schema import Config
from .values import is_auto, key_info

__all__ = ["AcceptedKey", "accepted_keys", "load_config", "notes", "read_json"]


@dataclass(frozen=True)
class AcceptedKey:
    """One JSON key the config accepts: ``path`` is dotted (``optimizer.params`` keys carry the type they belong
    to, ``optimizer.params.lr`` for ``type`` in ``types``); ``acts`` False means it is accepted and warned about;
    ``spelling`` is ``canonical``, ``alias``, ``deprecated`` (warns, acts like its canonical key) or ``legacy``."""

    path: str
    acts: bool
    spelling: str
    types: tuple[str, ...] = ()
    canonical: str = ""  # the dotted canonical spelling (== path for canonical keys)


# top-level blocks that act through hybridzero.monitor (which reads and checks them), not through the config tree
MONITOR_BLOCKS = frozenset({"tensorboard", "wandb", "csv_monitor", "comet"})
# every top-level block read and checked elsewhere: the monitors, and activation_checkpointing, which
# deepspeed.checkpointing.configure(deepspeed_config=...) reads (hybridzero.runtime.activation_checkpointing)
READ_ELSEWHERE = MONITOR_BLOCKS | {"activation_checkpointing"}


def _block_keys(cls: type[Block], prefix: str, types: tuple[str, ...] = ()) -> list[AcceptedKey]:
    out = [
        AcceptedKey(
            join_key(prefix, name), prefix == "" and name in READ_ELSEWHERE, "canonical", types, join_key(prefix, name)
        )
        for name in sorted(cls._ignored)
    ]
    out += [AcceptedKey(join_key(prefix, name), True, "legacy", types, join_key(prefix, name)) for name in cls._legacy]
    for field_name, field in cls.model_fields.items():
        info = key_info(field)
        names = (
            (
                (info.name, "canonical"),
                *((a, "alias") for a in info.aliases),
                *((d, "deprecated") for d in info.deprecated),
            )
            if info
            else (((field_name, "canonical"),) if cls._plain_names else ())
        )
        for name, kind in names:
            canonical = join_key(prefix, info.name if info else name)
            out.append(AcceptedKey(join_key(prefix, name), info.acts if info else True, kind, types, canonical))
            child = child_model(cls, name)
            if child is not None and kind == "canonical":
                out += _block_keys(child, join_key(prefix, name))
    return out


def accepted_keys() -> tuple[AcceptedKey, ...]:
    """Every key ``load_config`` accepts, derived from the models (the walk a test proves key by key)."""
    out = _block_keys(Config, "")
    tables: tuple[tuple[str, Mapping[str, type[Block]]], ...] = (
        ("optimizer.params", OPTIMIZER_PARAMS),
        ("scheduler.params", SCHEDULER_PARAMS),
    )
    for prefix, table in tables:
        by_model: dict[type[Block], list[str]] = {}
        for type_name, model in table.items():
            by_model.setdefault(model, []).append(type_name)
        for model, type_names in by_model.items():
            out += _block_keys(model, prefix, tuple(type_names))
    return tuple(out)


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for name, value in pairs:
        if name in seen:
            raise ValueError(f"duplicate key '{name}'")
        seen[name] = value
    return seen


def read_json(path: str | os.PathLike[str]) -> Mapping[str, Any]:
    """Parse the JSON object in ``path``; ConfigError naming the path if that fails (duplicate keys included)."""
    shown = os.fspath(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file '{shown}' does not exist", value=shown) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file '{shown}' cannot be read: {exc}", value=shown) from None
    try:
        data = json.loads(text, object_pairs_hook=_reject_duplicates)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and our duplicate-key error are ValueErrors
        raise ConfigError(
            f"config file '{shown}' is not valid JSON: {type(exc).__name__}: {exc}", value=shown
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{shown}' must hold a JSON object, not {type(data).__name__}", value=shown)
    return data


def _block_notes(block: Mapping[str, Any], cls: type[Block], prefix: str, out: dict[str, str]) -> None:
    """Record (once per dotted key) every deprecated spelling, ``"auto"`` note and key without effect in ``block``."""
    names = spellings(cls)
    for name, value in block.items():
        dotted = join_key(prefix, name)
        if prefix == "" and name in READ_ELSEWHERE:  # read and checked by hybridzero.monitor / deepspeed.checkpointing
            continue
        if name in cls._ignored or (name in names and not _acts(cls, names[name])):
            out.setdefault(
                dotted, f"config key '{dotted}' is accepted for DeepSpeed compatibility but has no effect in hybridzero"
            )
            continue
        if name in cls._legacy:
            new = join_key(prefix, cls._legacy[name])
            out.setdefault(dotted, f"config key '{dotted}' is deprecated; use '{new}': {{\"device\": \"cpu\"}}")
            continue
        info = key_info(cls.model_fields[names[name]]) if names.get(name) else None
        if info is not None and name in info.deprecated:
            out.setdefault(dotted, f"config key '{dotted}' is deprecated; use '{join_key(prefix, info.name)}'")
        if info is not None and info.auto_note and is_auto(value):
            out.setdefault(dotted, f"{dotted} = 'auto': {info.auto_note}")
        child = child_model(cls, name)
        if child is not None and isinstance(value, Mapping):
            _block_notes(value, child, dotted, out)


def _acts(cls: type[Block], field_name: str) -> bool:
    info = key_info(cls.model_fields[field_name])
    return info is None or info.acts


def _conditional_notes(cfg: Config, out: dict[str, str]) -> None:
    """Keys that act, but not at this ZeRO stage (or not with this gradient_allreduce_op)."""
    z = cfg.zero
    zeropp = (
        ("zero_hpz_partition_size", z.hpz_partition_size > 1, z.hpz_partition_size),
        ("zero_quantized_weights", z.quantized_weights, True),
        ("zero_quantized_nontrainable_weights", z.quantized_nontrainable_weights, True),
    )
    for name, is_set, value in zeropp:
        if z.stage < 3 and is_set:
            key = f"zero_optimization.{name}"
            out.setdefault(
                key,
                f"{key} = {show(value)} is a ZeRO-3 (ZeRO++) option and has no effect at "
                f"zero_optimization.stage = {z.stage}",
            )
    if cfg.gradient_allreduce_op == "sum":  # DeepSpeed divides only when averaging
        ignored: tuple[tuple[str, bool, object], ...] = (
            ("prescale_gradients", cfg.prescale_gradients, True),
            ("gradient_predivide_factor", cfg.gradient_predivide_factor != 1.0, cfg.gradient_predivide_factor),
        )
        for name, is_set, setting in ignored:
            if is_set:
                out.setdefault(
                    name,
                    f"{name} = {show(setting)} has no effect with gradient_allreduce_op = 'sum' (as in DeepSpeed, "
                    "the gradients are summed without any division)",
                )
    if not z.ignore_unused_parameters and z.stage not in (1, 2):
        key = "zero_optimization.ignore_unused_parameters"
        out.setdefault(
            key,
            f"{key} = false only acts at ZeRO stages 1 and 2 (as in DeepSpeed) and has no effect at "
            f"zero_optimization.stage = {z.stage}",
        )


def notes(raw: Mapping[str, Any], cfg: Config) -> tuple[str, ...]:
    """The warnings ``load_config`` gives for ``raw`` (which produced ``cfg``): at most one per dotted key."""
    out: dict[str, str] = {}
    if isinstance(raw.get("zero_optimization"), bool):
        value = raw["zero_optimization"]
        out["zero_optimization"] = f'zero_optimization = {show(value)} is deprecated; use {{"stage": {int(value)}}}'
    _block_notes(raw, Config, "", out)
    for name, block, table in (
        ("optimizer", cfg.optimizer, OPTIMIZER_PARAMS),
        ("scheduler", cfg.scheduler, SCHEDULER_PARAMS),
    ):
        params = raw[name].get("params") if block is not None else None
        if block is not None and isinstance(params, Mapping):
            _block_notes(params, table[block.type], f"{name}.params", out)
    _conditional_notes(cfg, out)
    return tuple(out.values())


def load_config(config: Mapping[str, Any] | str | os.PathLike[str], world_size: int) -> Config:
    """Load DeepSpeed JSON -- a mapping, or a path to a ``.json`` file -- as a :class:`Config`.

    ``world_size`` is the data-parallel world size the batch sizes are resolved against. Raises ConfigError naming
    the key (or file) on any invalid input. Keys accepted without effect, deprecated spellings, and settings with no
    effect at this stage each produce one ``UserWarning`` per call.
    """
    if isinstance(config, (str, os.PathLike)):
        raw = read_json(config)
    elif isinstance(config, Mapping):
        raw = config
    else:
        raise ConfigError(
            f"config must be a mapping or a path to a JSON file, not {type(config).__name__}", value=config
        )
    bad = [k for k in raw if not isinstance(k, str)]
    if bad:  # pydantic would build the Config with ``Config(**raw)``: a TypeError naming nothing
        raise ConfigError(f"config has a non-string key {bad[0]!r}; JSON keys are strings", key=str(bad[0]))
    if "world_size" in raw:  # a field of Config, but not a JSON key: the caller gives it
        raise unknown_key_error("", "world_size", spellings(Config))
    try:
        cfg = Config.model_validate({**raw, "world_size": world_size}, by_alias=True, by_name=False)
    except ValidationError as exc:
        raise to_config_error(exc, Config, "") from None
    cfg = cfg.with_raw(raw)
    for message in notes(raw, cfg):
        warnings.warn(message, UserWarning, stacklevel=2)
    return cfg

"""Optimizer and LR-scheduler blocks: supported types, their params, their defaults.

DeepSpeed passes ``optimizer.params`` / ``scheduler.params`` straight to a
constructor, so a misspelt name only fails (or is silently dropped) at engine
start. Here every name is checked against the constructor it will reach.
Defaults are DeepSpeed's *effective* ones (FusedAdam / torch.optim / DeepSpeed's
lr_schedules), e.g. ``"Adam"`` runs in AdamW mode unless ``adam_w_mode`` is false.
All tables are read-only; all functions are pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from .blocks import as_mapping
from .errors import ConfigError, join_key, show, unknown_key_error
from .values import Spec, coerce, describe

__all__ = [
    "OPTIMIZER_TYPES",
    "SCHEDULER_TYPES",
    "canonical_type",
    "optimizer_defaults",
    "scheduler_defaults",
    "validate_optimizer_params",
    "validate_scheduler_params",
]

OPTIMIZER_TYPES: tuple[str, ...] = ("Adam", "AdamW", "SGD")
SCHEDULER_TYPES: tuple[str, ...] = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


def _table(*specs: Spec) -> Mapping[str, Spec]:
    return MappingProxyType({spec.key: spec for spec in specs})


_LR = Spec("lr", "float", minimum=0.0)
_WEIGHT_DECAY = Spec("weight_decay", "float", minimum=0.0)
_TORCH_FLAGS = (
    Spec("maximize", "bool"),
    Spec("foreach", "bool", optional=True),
    Spec("differentiable", "bool"),
    Spec("fused", "bool", optional=True),
)

_ADAM_PARAMS = _table(
    _LR,
    Spec("betas", "pair", minimum=0.0, maximum=1.0, exclusive_maximum=True),
    Spec("eps", "float", minimum=0.0, exclusive_minimum=True),
    _WEIGHT_DECAY,
    Spec("adam_w_mode", "bool"),
    Spec("torch_adam", "bool"),
    Spec("bias_correction", "bool"),
    Spec("amsgrad", "bool"),
    Spec("set_grad_none", "bool"),
    Spec("capturable", "bool"),
    *_TORCH_FLAGS,
)
_SGD_PARAMS = _table(
    _LR,
    Spec("momentum", "float", minimum=0.0),
    Spec("dampening", "float"),
    _WEIGHT_DECAY,
    Spec("nesterov", "bool"),
    *_TORCH_FLAGS,
)
_OPTIMIZER_PARAMS: Mapping[str, Mapping[str, Spec]] = MappingProxyType(
    {"Adam": _ADAM_PARAMS, "AdamW": _ADAM_PARAMS, "SGD": _SGD_PARAMS}
)

_ADAM_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {
        "lr": 1e-3,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": 0.0,
        "adam_w_mode": True,
        "torch_adam": False,
        "bias_correction": True,
        "amsgrad": False,
    }
)
_SGD_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False}
)

_WARMUP_COMMON = (
    Spec("warmup_num_steps", "int", minimum=0),
    Spec("warmup_type", "str", choices=("log", "linear")),
    Spec("last_batch_iteration", "int", minimum=-1),
)
# Per-group lists are allowed (DeepSpeed's _format_param); warmup_max_lr null = the optimizer's lr.
_WARMUP_LR = (
    Spec("warmup_min_lr", "floats", minimum=0.0),
    Spec("warmup_max_lr", "floats", minimum=0.0, optional=True),
)
_TOTAL_STEPS = Spec("total_num_steps", "int", minimum=1)
_SCHEDULER_PARAMS: Mapping[str, Mapping[str, Spec]] = MappingProxyType(
    {
        "WarmupLR": _table(*_WARMUP_LR, *_WARMUP_COMMON),
        "WarmupDecayLR": _table(*_WARMUP_LR, _TOTAL_STEPS, *_WARMUP_COMMON),
        "WarmupCosineLR": _table(
            _TOTAL_STEPS,
            Spec("warmup_min_ratio", "float", minimum=0.0, maximum=1.0),
            Spec("cos_min_ratio", "float", minimum=0.0, maximum=1.0),
            *_WARMUP_COMMON,
        ),
    }
)
_SCHEDULER_REQUIRED: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {"WarmupLR": (), "WarmupDecayLR": ("total_num_steps",), "WarmupCosineLR": ("total_num_steps",)}
)
_WARMUP_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {"warmup_num_steps": 1000, "warmup_type": "log", "last_batch_iteration": -1}
)
_SCHEDULER_DEFAULTS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        # WarmupLR's warmup_max_lr default is None: the optimizer's (first group's) lr
        "WarmupLR": MappingProxyType({"warmup_min_lr": 0.0, "warmup_max_lr": None, **_WARMUP_DEFAULTS}),
        "WarmupDecayLR": MappingProxyType({"warmup_min_lr": 0.0, "warmup_max_lr": 0.001, **_WARMUP_DEFAULTS}),
        "WarmupCosineLR": MappingProxyType({"warmup_min_ratio": 0.0, "cos_min_ratio": 0.0001, **_WARMUP_DEFAULTS}),
    }
)


def canonical_type(value: Any, key: str, supported: tuple[str, ...], what: str) -> str:
    """The canonical spelling in ``supported`` matching ``value`` case-insensitively.

    Raises ConfigError naming ``key``, the value and the supported ``what``s.
    """
    if isinstance(value, str):
        for name in supported:
            if name.lower() == value.lower():
                return name
    listing = ", ".join(supported)
    raise ConfigError(
        f"{key} = {show(value)} is not supported; supported {what}: {listing} (case-insensitive)",
        key=key,
        value=value,
    )


def _validate_params(
    params: Any, prefix: str, table: Mapping[str, Spec], required: tuple[str, ...], owner: str
) -> dict[str, Any]:
    block = as_mapping(params, prefix)
    result: dict[str, Any] = {}
    for name, value in block.items():
        if not isinstance(name, str) or name not in table:
            raise unknown_key_error(prefix, str(name), table.keys())
        result[name] = coerce(value, table[name], join_key(prefix, name))
    for name in required:
        if name not in result:
            key = join_key(prefix, name)
            raise ConfigError(f"{key} is required for {owner}; set it to {describe(table[name])}", key=key)
    return result


def validate_optimizer_params(type_: str, params: Any) -> dict[str, Any]:
    """Typed copy of ``optimizer.params`` for canonical optimizer ``type_``.

    Invariants of the result: only names the target constructor accepts; numbers
    in range; ``betas`` a 2-tuple in [0, 1); SGD ``nesterov`` only with
    ``momentum > 0`` and ``dampening == 0`` (torch's rule, checked early).
    """
    prefix = "optimizer.params"
    if isinstance(params, Mapping) and "max_grad_norm" in params:
        key = join_key(prefix, "max_grad_norm")
        raise ConfigError(
            f"{key} = {show(params['max_grad_norm'])} is not supported (as in DeepSpeed); "
            "set the top-level 'gradient_clipping' instead",
            key=key,
            value=params["max_grad_norm"],
        )
    result = _validate_params(params, prefix, _OPTIMIZER_PARAMS[type_], (), type_)
    if type_ == "SGD" and result.get("nesterov", False):
        momentum, dampening = result.get("momentum", 0.0), result.get("dampening", 0.0)
        if momentum <= 0.0 or dampening != 0.0:
            raise ConfigError(
                f"{prefix}.nesterov = true requires {prefix}.momentum > 0 and {prefix}.dampening = 0 "
                f"(got momentum = {momentum:g}, dampening = {dampening:g})",
                key=join_key(prefix, "nesterov"),
                value=True,
            )
    return result


def validate_scheduler_params(type_: str, params: Any) -> dict[str, Any]:
    """Typed copy of ``scheduler.params`` for canonical scheduler ``type_``.

    Invariants of the result: only names DeepSpeed's ``type_`` constructor accepts,
    numbers in range, ``total_num_steps`` present for WarmupDecayLR / WarmupCosineLR.
    """
    return _validate_params(
        params, "scheduler.params", _SCHEDULER_PARAMS[type_], _SCHEDULER_REQUIRED[type_], type_
    )


def optimizer_defaults(type_: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """DeepSpeed's effective defaults for ``type_`` given the user's ``params``.

    For Adam/AdamW with ``torch_adam`` in AdamW mode the optimizer is
    ``torch.optim.AdamW``, whose ``weight_decay`` default is 0.01 (FusedAdam's is 0).
    """
    if type_ == "SGD":
        return dict(_SGD_DEFAULTS)
    defaults = dict(_ADAM_DEFAULTS)
    decoupled = type_ == "AdamW" or params.get("adam_w_mode", True)
    if params.get("torch_adam", False) and decoupled:
        defaults["weight_decay"] = 0.01
    return defaults


def scheduler_defaults(type_: str) -> dict[str, Any]:
    """DeepSpeed's defaults for the optional params of scheduler ``type_``."""
    return dict(_SCHEDULER_DEFAULTS[type_])

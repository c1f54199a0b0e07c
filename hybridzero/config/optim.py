"""Optimizer and LR-scheduler blocks: the one place their types and params are validated.

``hybridzero.optim.factory.build_optimizer`` and ``hybridzero.optim.schedulers.build_scheduler`` call
:func:`canonical_optimizer_type` / :func:`validate_optimizer_params` and :func:`canonical_scheduler_type` /
:func:`validate_scheduler_params`, so a block is judged by the same rules at config load and at construction (and
RLHF settings can call them too). Type names are matched case-insensitively, as DeepSpeed lower-cases optimizer
names. DeepSpeed passes ``params`` straight to a constructor, so a misspelt name fails late or is dropped; here
every name is checked against the constructor it will reach. Defaults are DeepSpeed's *effective* ones (FusedAdam /
torch.optim / DeepSpeed's lr_schedules): ``"Adam"`` runs in AdamW mode unless ``adam_w_mode`` is false.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Any, ClassVar

from pydantic import ValidationError, model_validator

from .base import Block, to_config_error
from .errors import ConfigError, join_key, show
from .values import BlockProblem, boolean, choice, floats, freeze, integer, key, number, optional, pair, thaw

__all__ = [
    "OPTIMIZER_PARAMS",
    "OPTIMIZER_TYPES",
    "SCHEDULER_PARAMS",
    "SCHEDULER_TYPES",
    "OptimizerConfig",
    "SchedulerConfig",
    "canonical_optimizer_type",
    "canonical_scheduler_type",
    "optimizer_defaults",
    "scheduler_defaults",
    "validate_optimizer_params",
    "validate_scheduler_params",
]

OPTIMIZER_TYPES: tuple[str, ...] = ("Adam", "AdamW", "SGD", "Adagrad", "Lion")
SCHEDULER_TYPES: tuple[str, ...] = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")


class _Params(Block):
    """Params of one optimizer/scheduler constructor: only its argument names (the field names), typed."""

    _plain_names: ClassVar[bool] = True


class _TorchFlags(_Params):
    maximize: Annotated[bool, boolean] = False
    foreach: Annotated[bool | None, optional(boolean)] = None
    differentiable: Annotated[bool, boolean] = False
    fused: Annotated[bool | None, optional(boolean)] = None


class AdamParams(_TorchFlags):
    """FusedAdam / torch Adam(W) arguments plus DeepSpeed's two switches."""

    lr: Annotated[float, number(0.0)] = 1e-3
    betas: Annotated[tuple[float, float], pair(0.0, 1.0, hi_open=True)] = (0.9, 0.999)
    eps: Annotated[float, number(0.0, lo_open=True)] = 1e-8
    weight_decay: Annotated[float, number(0.0)] = 0.0
    adam_w_mode: Annotated[bool, boolean] = True
    torch_adam: Annotated[bool, boolean] = False
    bias_correction: Annotated[bool, boolean] = True
    amsgrad: Annotated[bool, boolean] = False
    # FusedAdam's zero_grad switch; torch's zero_grad already sets None: no effect here
    set_grad_none: Annotated[bool, boolean] = key(True, "set_grad_none", acts=False)
    capturable: Annotated[bool, boolean] = False


class SGDParams(_TorchFlags):
    """torch.optim.SGD arguments."""

    lr: Annotated[float, number(0.0)] = 1e-3
    momentum: Annotated[float, number(0.0)] = 0.0
    dampening: Annotated[float, number()] = 0.0
    weight_decay: Annotated[float, number(0.0)] = 0.0
    nesterov: Annotated[bool, boolean] = False


class _Warmup(_Params):
    warmup_num_steps: Annotated[int, integer(0)] = 1000
    warmup_type: Annotated[str, choice("log", "linear")] = "log"
    last_batch_iteration: Annotated[int, integer(-1)] = -1


class WarmupLRParams(_Warmup):
    warmup_min_lr: Annotated[float | tuple[float, ...], floats(0.0)] = 0.0
    # None: the optimizer's (per-group) lr
    warmup_max_lr: Annotated[float | tuple[float, ...] | None, floats(0.0, nullable=True)] = None


class WarmupDecayLRParams(WarmupLRParams):
    warmup_max_lr: Annotated[float | tuple[float, ...] | None, floats(0.0, nullable=True)] = 0.001
    total_num_steps: Annotated[int | None, optional(integer(1))] = None  # required (checked with DeepSpeed's message)


class WarmupCosineLRParams(_Warmup):
    total_num_steps: Annotated[int | None, optional(integer(1))] = None  # required
    warmup_min_ratio: Annotated[float, number(0.0, 1.0)] = 0.0
    cos_min_ratio: Annotated[float, number(0.0, 1.0)] = 0.0001


class AdagradParams(_TorchFlags):
    """torch.optim.Adagrad arguments (DeepSpeed builds torch's Adagrad, or its CPU Adagrad of the same update and
    defaults under optimizer offload)."""

    lr: Annotated[float, number(0.0)] = 1e-2
    lr_decay: Annotated[float, number(0.0)] = 0.0
    weight_decay: Annotated[float, number(0.0)] = 0.0
    initial_accumulator_value: Annotated[float, number(0.0)] = 0.0
    eps: Annotated[float, number(0.0, lo_open=True)] = 1e-10


class LionParams(_Params):
    """DeepSpeed's FusedLion / CPU Lion arguments (:mod:`hybridzero.optim.lion`)."""

    lr: Annotated[float, number(0.0)] = 1e-3
    betas: Annotated[tuple[float, float], pair(0.0, 1.0, hi_open=True)] = (0.9, 0.999)
    weight_decay: Annotated[float, number(0.0)] = 0.0
    # FusedLion's zero_grad switch; the engine's zero_grad already sets None: no effect here
    set_grad_none: Annotated[bool, boolean] = key(True, "set_grad_none", acts=False)


class _Resumable(_Params):
    """DeepSpeed's ``last_batch_iteration``: -1 starts the schedule, ``i >= 0`` resumes after iteration ``i``."""

    last_batch_iteration: Annotated[int, integer(-1)] = -1


class LRRangeTestParams(_Resumable):
    """DeepSpeed's LRRangeTest: ``lr = min_lr * (1 + step_rate * (i + 1) / step_size)`` (floored interval with
    ``staircase``)."""

    lr_range_test_min_lr: Annotated[float | tuple[float, ...], floats(0.0)] = 1e-3
    lr_range_test_step_size: Annotated[int, integer(1)] = 2000
    lr_range_test_step_rate: Annotated[float, number(0.0)] = 1.0
    lr_range_test_staircase: Annotated[bool, boolean] = False


class OneCycleParams(_Resumable):
    """DeepSpeed's OneCycle (:mod:`hybridzero.optim.cycle_schedulers`); ``cycle_min_lr`` and ``cycle_max_lr`` are
    required."""

    cycle_min_lr: Annotated[float | tuple[float, ...] | None, floats(0.0, nullable=True)] = None
    cycle_max_lr: Annotated[float | tuple[float, ...] | None, floats(0.0, nullable=True)] = None
    decay_lr_rate: Annotated[float, number(0.0)] = 0.0
    cycle_first_step_size: Annotated[int, integer(1)] = 2000
    cycle_second_step_size: Annotated[int | None, optional(integer(0))] = None
    cycle_first_stair_count: Annotated[int, integer(0)] = 0
    cycle_second_stair_count: Annotated[int | None, optional(integer(0))] = None
    decay_step_size: Annotated[int, integer(0)] = 0
    cycle_momentum: Annotated[bool, boolean] = True
    cycle_min_mom: Annotated[float | tuple[float, ...], floats(0.0)] = 0.8
    cycle_max_mom: Annotated[float | tuple[float, ...], floats(0.0)] = 0.9
    decay_mom_rate: Annotated[float, number(0.0)] = 0.0


OPTIMIZER_PARAMS: Mapping[str, type[_Params]] = MappingProxyType(
    {"Adam": AdamParams, "AdamW": AdamParams, "SGD": SGDParams, "Adagrad": AdagradParams, "Lion": LionParams}
)
SCHEDULER_PARAMS: Mapping[str, type[_Params]] = MappingProxyType(
    {
        "WarmupLR": WarmupLRParams,
        "WarmupDecayLR": WarmupDecayLRParams,
        "WarmupCosineLR": WarmupCosineLRParams,
        "OneCycle": OneCycleParams,
        "LRRangeTest": LRRangeTestParams,
    }
)


def _canonical(value: Any, key: str, supported: tuple[str, ...], what: str) -> str:
    if isinstance(value, str):
        for name in supported:
            if name.lower() == value.lower():
                return name
    raise ConfigError(
        f"{key} = {show(value)} is not supported; supported {what}: {', '.join(supported)} (case-insensitive)",
        key=key,
        value=value,
    )


def canonical_optimizer_type(value: Any) -> str:
    """One of :data:`OPTIMIZER_TYPES` for ``value`` in any case; ConfigError naming ``optimizer.type``."""
    return _canonical(value, "optimizer.type", OPTIMIZER_TYPES, "optimizers")


def canonical_scheduler_type(value: Any) -> str:
    """One of :data:`SCHEDULER_TYPES` for ``value`` in any case; ConfigError naming ``scheduler.type``."""
    return _canonical(value, "scheduler.type", SCHEDULER_TYPES, "schedulers")


def _validate(model: type[_Params], params: Any, prefix: str) -> dict[str, Any]:
    """Typed copy of the names given in ``params`` (only those); ConfigError naming ``prefix.<name>``."""
    if params is None:
        return {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"{prefix} = {show(params)} is invalid: expected a JSON object", key=prefix, value=params)
    bad = [k for k in params if not isinstance(k, str)]
    if bad:
        raise ConfigError(f"{prefix} has a non-string key {bad[0]!r}; JSON keys are strings", key=prefix, value=params)
    try:
        typed = model.model_validate(dict(params))
    except ValidationError as exc:
        raise to_config_error(exc, model, prefix) from None
    return {name: getattr(typed, name) for name in typed.model_fields_set}


def validate_optimizer_params(type_: str, params: Any) -> dict[str, Any]:
    """Typed copy of ``optimizer.params`` for canonical optimizer ``type_`` (only the names given).

    Invariants of the result: only names the target constructor accepts; numbers in range; ``betas`` a 2-tuple in
    [0, 1); no ``max_grad_norm`` (``gradient_clipping`` does that); ``amsgrad`` only with ``torch_adam`` (FusedAdam
    has none); ``bias_correction`` true (torch always corrects); SGD ``nesterov`` only with ``momentum > 0`` and
    ``dampening == 0`` (torch's rule, checked early).
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
    result = _validate(OPTIMIZER_PARAMS[type_], params, prefix)
    if result.get("amsgrad") and not result.get("torch_adam"):
        raise ConfigError(
            f"{prefix}.amsgrad = true requires {prefix}.torch_adam = true (DeepSpeed's FusedAdam and "
            "CPU Adam do not support AMSGrad)",
            key=f"{prefix}.amsgrad",
            value=True,
        )
    if result.get("bias_correction") is False:
        raise ConfigError(
            f"{prefix}.bias_correction = false is not supported: torch's Adam/AdamW always apply bias correction",
            key=f"{prefix}.bias_correction",
            value=False,
        )
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
    """Typed copy of ``scheduler.params`` for canonical scheduler ``type_`` (only the names given);
    ``total_num_steps`` is required for WarmupDecayLR / WarmupCosineLR, ``cycle_min_lr`` and ``cycle_max_lr`` for
    OneCycle."""
    prefix = "scheduler.params"
    result = _validate(SCHEDULER_PARAMS[type_], params, prefix)
    if type_ == "OneCycle":
        for name in ("cycle_min_mom", "cycle_max_mom"):
            value = result.get(name)
            if value is not None and any(m >= 1.0 for m in (value if isinstance(value, tuple) else (value,))):
                key = join_key(prefix, name)
                raise ConfigError(
                    f"{key} = {show(thaw(value))} is invalid: a momentum (Adam's beta1) must be below 1",
                    key=key,
                    value=value,
                )
        for name in ("cycle_min_lr", "cycle_max_lr"):
            if result.get(name) is None:
                key = join_key(prefix, name)
                raise ConfigError(
                    f"{key} is required for OneCycle; set it to a number >= 0 (or a list, one per group)", key=key
                )
        return result
    if type_ in ("WarmupDecayLR", "WarmupCosineLR") and result.get("total_num_steps") is None:
        key = join_key(prefix, "total_num_steps")
        raise ConfigError(f"{key} is required for {type_}; set it to an integer >= 1", key=key)
    return result


def optimizer_defaults(type_: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """DeepSpeed's effective defaults for ``type_`` given the user's ``params``.

    For Adam/AdamW with ``torch_adam`` in AdamW mode the optimizer is ``torch.optim.AdamW``, whose ``weight_decay``
    default is 0.01 (FusedAdam's is 0).
    """
    if type_ in ("SGD", "Adagrad", "Lion"):
        plain = OPTIMIZER_PARAMS[type_]().model_dump().items()
        return {k: v for k, v in plain if k not in _TorchFlags.model_fields and k != "set_grad_none"}
    names = ("lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "bias_correction", "amsgrad")
    defaults = {k: getattr(AdamParams(), k) for k in names}
    decoupled = type_ == "AdamW" or params.get("adam_w_mode", True)
    if params.get("torch_adam", False) and decoupled:
        defaults["weight_decay"] = 0.01
    return defaults


def scheduler_defaults(type_: str) -> dict[str, Any]:
    """DeepSpeed's defaults for the optional params of scheduler ``type_``."""
    required = ("total_num_steps", "cycle_min_lr", "cycle_max_lr")
    return {k: v for k, v in SCHEDULER_PARAMS[type_]().model_dump().items() if k not in required}


class _TypedBlock(Block):
    """``{"type": ..., "params": {...}}``; ``params`` is a deep read-only mapping of the names given."""

    _canonical: ClassVar[Any]
    _validate_params: ClassVar[Any]
    _supported: ClassVar[tuple[str, ...]]

    type: str = key(..., "type")
    params: Any = key(MappingProxyType({}), "params")

    @model_validator(mode="before")
    @classmethod
    def _typed(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        if data.get("type") is None:
            raise BlockProblem(
                f"{{0}} is required in '{cls._prefix}'; supported: {', '.join(cls._supported)}", ("type",)
            )
        canonical = cls._canonical(data["type"])
        return {**data, "type": canonical, "params": freeze(cls._validate_params(canonical, data.get("params")))}

    def __getstate__(self) -> dict[Any, Any]:
        state = super().__getstate__()
        return {**state, "__dict__": {**state["__dict__"], "params": thaw(self.params)}}

    def __setstate__(self, state: dict[Any, Any]) -> None:
        fields = {**state["__dict__"], "params": freeze(state["__dict__"]["params"])}
        super().__setstate__({**state, "__dict__": fields})

    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> _TypedBlock:
        return self  # immutable all the way down

    def __copy__(self) -> _TypedBlock:
        return self


class OptimizerConfig(_TypedBlock):
    """The ``optimizer`` block: ``type`` canonical (one of :data:`OPTIMIZER_TYPES`; input case-insensitive);
    ``params`` read-only, holding only the names the user gave, each valid for ``type`` (see
    :meth:`resolved_params` for the values with DeepSpeed's defaults filled in)."""

    _prefix: ClassVar[str] = "optimizer"
    _ignored: ClassVar[frozenset[str]] = frozenset({"legacy_fusion"})
    _canonical = staticmethod(canonical_optimizer_type)
    _validate_params = staticmethod(validate_optimizer_params)
    _supported = OPTIMIZER_TYPES

    @property
    def decoupled_weight_decay(self) -> bool:
        """AdamW-style weight decay. DeepSpeed: ``"AdamW"``, or ``"Adam"`` unless ``adam_w_mode`` is false; ``"Lion"``
        always; ``"SGD"`` and ``"Adagrad"`` add it to the gradient."""
        if self.type in ("SGD", "Adagrad"):
            return False
        if self.type == "Lion":
            return True
        return self.type == "AdamW" or bool(self.params.get("adam_w_mode", True))

    def resolved_params(self) -> Mapping[str, Any]:
        """``params`` over DeepSpeed's effective defaults for ``type`` (read-only)."""
        return freeze({**optimizer_defaults(self.type, self.params), **self.params})


class SchedulerConfig(_TypedBlock):
    """The ``scheduler`` block: ``type`` canonical (one of :data:`SCHEDULER_TYPES`); ``params`` read-only, only names
    valid for ``type``, with the names ``type`` requires (``total_num_steps``; OneCycle's ``cycle_min_lr`` and
    ``cycle_max_lr``)."""

    _prefix: ClassVar[str] = "scheduler"
    _canonical = staticmethod(canonical_scheduler_type)
    _validate_params = staticmethod(validate_scheduler_params)
    _supported = SCHEDULER_TYPES

    def resolved_params(self) -> Mapping[str, Any]:
        """``params`` over DeepSpeed's defaults for ``type`` (read-only)."""
        return freeze({**scheduler_defaults(self.type), **self.params})

"""The typed, frozen config tree -- the single home of hybridzero's config defaults.

Every field that comes from a DeepSpeed JSON key carries a :class:`Spec` naming
that key, so defaults, types, ranges and JSON spellings live in one place.
Each dataclass re-validates itself in ``__post_init__``: constructing one
directly enforces the same invariants as :func:`hybridzero.config.load_config`.
Defaults are DeepSpeed's effective defaults; the few deliberate differences
(bucket sizes must be >= 1; ``gradient_clipping`` stays 0.0) are noted where they occur.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch

from .errors import ConfigError
from .optim import (
    OPTIMIZER_TYPES,
    SCHEDULER_TYPES,
    canonical_type,
    optimizer_defaults,
    scheduler_defaults,
    validate_optimizer_params,
    validate_scheduler_params,
)
from .validate import check_batch, check_hpz, check_loss_scaling, check_precision, check_world_size
from .values import Spec, freeze, spec_field, thaw, validate_fields

__all__ = [
    "BF16Config",
    "Config",
    "FP16Config",
    "HybridEngineConfig",
    "OffloadConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "ZeroConfig",
]

# Shared Spec arguments. Element counts may be 0; bucket sizes may not (a 0-element
# bucket never fills). "auto" means the default, as in DeepSpeed's non-strict parsing.
_SIZE: Mapping[str, Any] = MappingProxyType({"kind": "int", "minimum": 0, "auto_default": True})
_BUCKET: Mapping[str, Any] = MappingProxyType({"kind": "int", "minimum": 1, "auto_default": True})


def _empty() -> Mapping[str, Any]:
    return MappingProxyType({})


def _rebuild(cls: type, kwargs: dict[str, Any]) -> Any:
    return cls(**kwargs)


def _reduce(obj: Any) -> tuple[Any, tuple[type, dict[str, Any]]]:
    """Pickle/deepcopy support: ``MappingProxyType`` fields travel as plain dicts and
    are re-frozen (and re-validated) by ``__post_init__`` on the way back in."""
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        kwargs[f.name] = thaw(value) if isinstance(value, Mapping) else value
    return _rebuild, (type(obj), kwargs)


def _require(value: Any, cls: type, name: str) -> None:
    if not isinstance(value, cls):
        raise ConfigError(f"{name} must be a {cls.__name__}, got {type(value).__name__}", key=name, value=value)


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    """One ``zero_optimization.offload_*`` block.

    Invariants: ``device`` is ``"none"``, ``"cpu"`` or ``"nvme"`` (lower case);
    ``nvme_path`` is a string or ``None`` (``load_config`` requires it for ``"nvme"``).
    DeepSpeed's pydantic default device is ``"none"``.
    """

    device: str = spec_field(Spec("device", "str", choices=("none", "cpu", "nvme")), "none")
    pin_memory: bool = spec_field(Spec("pin_memory", "bool"), False)
    nvme_path: str | None = spec_field(Spec("nvme_path", "str", optional=True), None)

    def __post_init__(self) -> None:
        validate_fields(self, "offload")

    @property
    def enabled(self) -> bool:
        """True when something is offloaded (``device != "none"``)."""
        return self.device != "none"


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
    """The ``zero_optimization`` block.

    Invariants: ``0 <= stage <= 3``; sizes/thresholds are ints >= 0 and bucket
    sizes ints >= 1 (elements, not bytes); ``hpz_partition_size >= 1``;
    ``overlap_comm`` is a bool after construction -- passing ``None`` (or omitting
    it in JSON) gives DeepSpeed's effective default, ``stage == 3``.
    """

    stage: int = spec_field(Spec("stage", "int", minimum=0, maximum=3), 0)
    prefetch_bucket_size: int = spec_field(
        Spec("stage3_prefetch_bucket_size", aliases=("prefetch_bucket_size",), **_SIZE), 50_000_000
    )
    param_persistence_threshold: int = spec_field(
        Spec("stage3_param_persistence_threshold", aliases=("param_persistence_threshold",), **_SIZE), 100_000
    )
    max_live_parameters: int = spec_field(
        Spec("stage3_max_live_parameters", aliases=("max_live_parameters",), **_SIZE), 1_000_000_000
    )
    max_reuse_distance: int = spec_field(
        Spec("stage3_max_reuse_distance", aliases=("max_reuse_distance",), **_SIZE), 1_000_000_000
    )
    reduce_bucket_size: int = spec_field(Spec("reduce_bucket_size", **_BUCKET), 500_000_000)
    allgather_bucket_size: int = spec_field(Spec("allgather_bucket_size", **_BUCKET), 500_000_000)
    overlap_comm: bool | None = spec_field(Spec("overlap_comm", "bool", optional=True), None)
    contiguous_gradients: bool = spec_field(Spec("contiguous_gradients", "bool"), True)
    reduce_scatter: bool = spec_field(Spec("reduce_scatter", "bool"), True)
    sub_group_size: int = spec_field(Spec("sub_group_size", **_BUCKET), 1_000_000_000)
    hpz_partition_size: int = spec_field(Spec("zero_hpz_partition_size", "int", minimum=1), 1)
    quantized_weights: bool = spec_field(Spec("zero_quantized_weights", "bool"), False)
    quantized_gradients: bool = spec_field(Spec("zero_quantized_gradients", "bool"), False)
    quantized_nontrainable_weights: bool = spec_field(Spec("zero_quantized_nontrainable_weights", "bool"), False)
    # hybridzero extensions (not DeepSpeed keys): the qwZ/qgZ block size and the qgZ bit width (8, or 4)
    quantization_block_size: int = spec_field(Spec("zero_quantization_block_size", "int", minimum=2), 2048)
    quantized_gradients_bits: int = spec_field(Spec("zero_quantized_gradients_bits", "int", minimum=4, maximum=8), 8)
    offload_optimizer: OffloadConfig = OffloadConfig()
    offload_param: OffloadConfig = OffloadConfig()
    gather_16bit_weights_on_model_save: bool = spec_field(
        Spec(
            "stage3_gather_16bit_weights_on_model_save",
            "bool",
            aliases=("gather_16bit_weights_on_model_save",),
            deprecated=("stage3_gather_fp16_weights_on_model_save",),
        ),
        False,
    )

    def __post_init__(self) -> None:
        validate_fields(self, "zero_optimization")
        if self.overlap_comm is None:
            object.__setattr__(self, "overlap_comm", self.stage == 3)
        _require(self.offload_optimizer, OffloadConfig, "zero_optimization.offload_optimizer")
        _require(self.offload_param, OffloadConfig, "zero_optimization.offload_param")


@dataclasses.dataclass(frozen=True)
class FP16Config:
    """The ``fp16`` block (DeepSpeed's defaults: dynamic scaling from 2**16).

    Invariants: ``loss_scale >= 0`` (0 = dynamic); when fp16 is enabled with
    dynamic scaling, ``loss_scale_window >= 1``, ``hysteresis >= 1`` and
    ``min_loss_scale > 0`` (DeepSpeed only checks these when they take effect).
    """

    enabled: bool = spec_field(Spec("enabled", "bool"), False)
    loss_scale: float = spec_field(Spec("loss_scale", "float", minimum=0.0), 0.0)
    initial_scale_power: int = spec_field(Spec("initial_scale_power", "int", minimum=0), 16)
    loss_scale_window: int = spec_field(Spec("loss_scale_window", "int"), 1000)
    hysteresis: int = spec_field(Spec("hysteresis", "int"), 2)
    consecutive_hysteresis: bool = spec_field(Spec("consecutive_hysteresis", "bool"), False)
    min_loss_scale: float = spec_field(Spec("min_loss_scale", "float"), 1.0)

    def __post_init__(self) -> None:
        validate_fields(self, "fp16")
        check_loss_scaling(self)

    @property
    def dynamic_loss_scale(self) -> bool:
        """True when fp16 is on and the loss scale is dynamic (``loss_scale == 0``)."""
        return self.enabled and self.loss_scale == 0.0

    @property
    def initial_loss_scale(self) -> float:
        """The scale training starts at: ``2**initial_scale_power`` if dynamic, else ``loss_scale``."""
        return float(2**self.initial_scale_power) if self.loss_scale == 0.0 else self.loss_scale


@dataclasses.dataclass(frozen=True)
class BF16Config:
    """The ``bf16`` block (legacy spelling ``bfloat16``). bf16 needs no loss scaling."""

    enabled: bool = spec_field(Spec("enabled", "bool"), False)

    def __post_init__(self) -> None:
        validate_fields(self, "bf16")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """The ``optimizer`` block.

    Invariants: ``type`` is canonical (``"Adam"``, ``"AdamW"`` or ``"SGD"``; input is
    case-insensitive); ``params`` is a deep read-only mapping holding only the
    names the user gave, each valid for ``type`` (see :meth:`resolved_params` for
    the values with DeepSpeed's defaults filled in).
    """

    type: str
    params: Mapping[str, Any] = dataclasses.field(default_factory=_empty)

    def __post_init__(self) -> None:
        canonical = canonical_type(self.type, "optimizer.type", OPTIMIZER_TYPES, "optimizers")
        params = validate_optimizer_params(canonical, {} if self.params is None else self.params)
        object.__setattr__(self, "type", canonical)
        object.__setattr__(self, "params", freeze(params))

    def __reduce__(self) -> tuple[Any, ...]:
        return _reduce(self)

    @property
    def decoupled_weight_decay(self) -> bool:
        """AdamW-style weight decay. DeepSpeed: ``"AdamW"``, or ``"Adam"`` unless ``adam_w_mode`` is false."""
        if self.type == "SGD":
            return False
        return self.type == "AdamW" or bool(self.params.get("adam_w_mode", True))

    def resolved_params(self) -> Mapping[str, Any]:
        """``params`` over DeepSpeed's effective defaults for ``type`` (read-only)."""
        return freeze({**optimizer_defaults(self.type, self.params), **self.params})


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """The ``scheduler`` block.

    Invariants: ``type`` is canonical (``"WarmupLR"``, ``"WarmupDecayLR"`` or
    ``"WarmupCosineLR"``); ``params`` is read-only, holds only names valid for
    ``type`` and includes ``total_num_steps`` where ``type`` requires it.
    """

    type: str
    params: Mapping[str, Any] = dataclasses.field(default_factory=_empty)

    def __post_init__(self) -> None:
        canonical = canonical_type(self.type, "scheduler.type", SCHEDULER_TYPES, "schedulers")
        params = validate_scheduler_params(canonical, {} if self.params is None else self.params)
        object.__setattr__(self, "type", canonical)
        object.__setattr__(self, "params", freeze(params))

    def __reduce__(self) -> tuple[Any, ...]:
        return _reduce(self)

    def resolved_params(self) -> Mapping[str, Any]:
        """``params`` over DeepSpeed's defaults for ``type`` (read-only)."""
        return freeze({**scheduler_defaults(self.type), **self.params})


@dataclasses.dataclass(frozen=True)
class HybridEngineConfig:
    """The ``hybrid_engine`` block (train <-> generate switching).

    Invariants: ``max_out_tokens >= 1``; ``tp_gather_partition_size >= 1``;
    ``inference_tp_size == 1`` (tensor-parallel inference is not supported).
    """

    enabled: bool = spec_field(Spec("enabled", "bool"), False)
    max_out_tokens: int = spec_field(Spec("max_out_tokens", "int", minimum=1), 512)
    inference_tp_size: int = spec_field(Spec("inference_tp_size", "int", minimum=1), 1)
    release_inference_cache: bool = spec_field(Spec("release_inference_cache", "bool"), False)
    pin_parameters: bool = spec_field(Spec("pin_parameters", "bool"), True)
    tp_gather_partition_size: int = spec_field(Spec("tp_gather_partition_size", "int", minimum=1), 8)

    def __post_init__(self) -> None:
        validate_fields(self, "hybrid_engine")
        if self.inference_tp_size != 1:
            raise ConfigError(
                f"hybrid_engine.inference_tp_size = {self.inference_tp_size} is not supported: "
                "tensor-parallel inference is not supported by hybridzero; use 1",
                key="hybrid_engine.inference_tp_size",
                value=self.inference_tp_size,
            )


@dataclasses.dataclass(frozen=True)
class Config:
    """The whole config: one typed, frozen tree built from DeepSpeed JSON.

    Invariants: ``train_batch_size == train_micro_batch_size_per_gpu *
    gradient_accumulation_steps * world_size`` with all four >= 1; fp16 and bf16
    are not both enabled; ``zero.hpz_partition_size`` divides ``world_size``;
    ``raw`` is a deep read-only copy of the JSON it came from (``raw_dict()`` for
    a mutable one). ``gradient_clipping`` 0 means no clipping; 0.0 is the default of
    every DeepSpeed release before deepspeedai/DeepSpeed#8068, which changed it to 1.0.
    """

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    gradient_clipping: float = spec_field(
        Spec(
            "gradient_clipping",
            "float",
            minimum=0.0,
            auto_default=True,
            auto_note="no trainer fills it here, so it means the default 0.0 (no clipping); "
            "the HF Trainer would use max_grad_norm (1.0 by default) -- set it explicitly",
        ),
        0.0,
    )
    zero: ZeroConfig = ZeroConfig()
    fp16: FP16Config = FP16Config()
    bf16: BF16Config = BF16Config()
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    hybrid_engine: HybridEngineConfig = HybridEngineConfig()
    communication_data_type: str | None = spec_field(
        Spec("communication_data_type", "str", choices=("fp32", "fp16", "bf16"), optional=True), None
    )
    steps_per_print: int = spec_field(Spec("steps_per_print", "int", minimum=1), 10)
    wall_clock_breakdown: bool = spec_field(Spec("wall_clock_breakdown", "bool"), False)
    prescale_gradients: bool = spec_field(Spec("prescale_gradients", "bool"), False)
    gradient_predivide_factor: float = spec_field(
        Spec("gradient_predivide_factor", "float", minimum=0.0, exclusive_minimum=True), 1.0
    )
    seed: int | None = spec_field(Spec("seed", "int", minimum=0, optional=True), None)
    raw: Mapping[str, Any] = dataclasses.field(default_factory=_empty, repr=False, compare=False)
    world_size: int = 1

    def __post_init__(self) -> None:
        validate_fields(self, "")
        for name, cls in (("zero", ZeroConfig), ("fp16", FP16Config), ("bf16", BF16Config)):
            _require(getattr(self, name), cls, name)
        _require(self.hybrid_engine, HybridEngineConfig, "hybrid_engine")
        if self.optimizer is not None:
            _require(self.optimizer, OptimizerConfig, "optimizer")
        if self.scheduler is not None:
            _require(self.scheduler, SchedulerConfig, "scheduler")
        object.__setattr__(self, "raw", freeze(self.raw))
        check_world_size(self.world_size)
        check_batch(self.train_batch_size, self.train_micro_batch_size_per_gpu,
                    self.gradient_accumulation_steps, self.world_size)
        check_precision(self.fp16.enabled, self.bf16.enabled)
        check_hpz(self.zero.hpz_partition_size, self.world_size)

    def __reduce__(self) -> tuple[Any, ...]:
        return _reduce(self)

    @property
    def compute_dtype(self) -> torch.dtype:
        """Training compute dtype: bf16 or fp16 when enabled, else fp32."""
        if self.bf16.enabled:
            return torch.bfloat16
        if self.fp16.enabled:
            return torch.float16
        return torch.float32

    @property
    def communication_dtype(self) -> torch.dtype:
        """Gradient-communication dtype: ``communication_data_type`` or, unset, the compute dtype."""
        by_name = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
        return by_name[self.communication_data_type] if self.communication_data_type else self.compute_dtype

    @property
    def dp_world_size(self) -> int:
        """Data-parallel world size the batch sizes were resolved against."""
        return self.world_size

    def raw_dict(self) -> dict[str, Any]:
        """A mutable, JSON-serialisable copy of ``raw``."""
        return thaw(self.raw)

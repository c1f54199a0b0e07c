"""The whole config: one typed, frozen pydantic tree built from DeepSpeed JSON -- the single home of defaults.

The top-level keys are here; the blocks below them are in :mod:`.models` and :mod:`.optim`. Constructing a model
directly (``Config(8, 4, 2, world_size=1)``, ``ZeroConfig(stage=3)``) enforces the same invariants as
:func:`hybridzero.config.load_config`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar

import torch
from pydantic import PrivateAttr, model_validator

from .base import Block, spellings
from .batch import BATCH_KEYS, resolve_batch_sizes
from .errors import ConfigAssertionError, ConfigError, show, unknown_key_error
from .models import BF16Config, FP16Config, HybridEngineConfig, ZeroConfig
from .optim import OptimizerConfig, SchedulerConfig
from .values import boolean, choice, freeze, integer, interval, is_auto, key, number, optional, thaw

__all__ = ["TOP_IGNORED", "Config"]

TOP_IGNORED: frozenset[str] = frozenset(
    {
        # optimizer plumbing
        "zero_allow_untested_optimizer",
        # monitoring / logging / profiling
        "activation_checkpointing",
        "flops_profiler",
        "tensorboard",
        "wandb",
        "csv_monitor",
        "comet",
        "comms_logger",
        "dump_state",
        "memory_breakdown",
        "timers",
        "log_level",
        # precision / communication variants
        "amp",
        "torch_autocast",
        "data_types",
        "fp32_allreduce",
        "sparse_gradients",
        "disable_allgather",
        "seq_parallel_communication_data_type",
        "graph_harvesting",
        # training features and parallelism plans
        "elasticity",
        "autotuning",
        "eigenvalue",
        "progressive_layer_drop",
        "curriculum_learning",
        "data_efficiency",
        "sparse_attention",
        "pipeline",
        "tensor_parallel",
        "use_data_before_expert_parallelism",
        "compression_training",
        "quantize_training",
        "weight_quantization",
        "compile",
        # I/O, checkpointing, runtime knobs
        "checkpoint",
        "aio",
        "nebula",
        "datastates",
        "dataloader_drop_last",
        "vocabulary_size",
        "disable_python_gc",
    }
)
_BLOCKS = ("zero_optimization", "fp16", "bf16", "bfloat16", "hybrid_engine")
_CLIP_AUTO = (
    "no trainer fills it here, so it means the default 0.0 (no clipping); the HF Trainer would use "
    "max_grad_norm (1.0 by default) -- set it explicitly"
)


def _world_size(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"world_size = {show(value)} is invalid: expected an integer >= 1", key="world_size", value=value
        )
    return value


def _batch_value(value: Any) -> Any:
    """None for absent/``"auto"``; an integral float as int (JSON writers emit 1.6e1); anything else unchanged."""
    if value is None or is_auto(value):
        return None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


NCCL_START_ALIGNMENT_FACTOR = 2
"""DeepSpeed's ZeRO 1/2 partition alignment in elements (4 bytes in 16-bit); ``zero.layout.PARTITION_ALIGN`` pads
every gather group's partitions to it, and ``allgather_bucket_size`` must be a multiple of it at stages 1-2."""


class Config(Block):
    """The whole config.

    Invariants: ``train_batch_size == train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size /
    sequence_parallel_size``
    with all four >= 1; fp16 and bf16 are not both enabled; ``zero.hpz_partition_size`` and
    ``hybrid_engine.inference_tp_size`` divide ``world_size``; at stages 1-2 ``zero.allgather_bucket_size`` is a
    multiple of ``NCCL_START_ALIGNMENT_FACTOR`` (DeepSpeed asserts it; it has no other effect here);
    ``raw`` is a deep read-only copy of the JSON
    it came from (``raw_dict()`` for a mutable one). ``gradient_clipping`` 0 means no clipping; 0.0 is the default
    of every DeepSpeed release before deepspeedai/DeepSpeed#8068, which changed it to 1.0.
    """

    _ignored: ClassVar[frozenset[str]] = TOP_IGNORED

    train_batch_size: int = key(..., "train_batch_size", note="batch arithmetic")
    train_micro_batch_size_per_gpu: int = key(..., "train_micro_batch_size_per_gpu", note="dataloader")
    gradient_accumulation_steps: int = key(..., "gradient_accumulation_steps", note="engine.step")
    gradient_clipping: Annotated[float, number(0.0)] = key(0.0, "gradient_clipping", auto=True, auto_note=_CLIP_AUTO)
    zero: ZeroConfig = key(ZeroConfig(), "zero_optimization")
    fp16: FP16Config = key(FP16Config(), "fp16")
    bf16: BF16Config = key(BF16Config(), "bf16", deprecated=("bfloat16",))
    optimizer: OptimizerConfig | None = key(None, "optimizer", note="optim.factory")
    scheduler: SchedulerConfig | None = key(None, "scheduler", note="optim.schedulers")
    hybrid_engine: HybridEngineConfig = key(HybridEngineConfig(), "hybrid_engine")
    communication_data_type: Annotated[str | None, optional(choice("fp32", "fp16", "bf16"))] = key(
        None, "communication_data_type"
    )
    steps_per_print: Annotated[int, interval()] = key(10, "steps_per_print", note="engine.step's progress log")
    wall_clock_breakdown: Annotated[bool, boolean] = key(False, "wall_clock_breakdown", acts=False)
    # the gradient reduction (zero.reduce.reduction_scales): DeepSpeed's pre/post scaling and its op
    prescale_gradients: Annotated[bool, boolean] = key(False, "prescale_gradients", note="zero.reduce")
    gradient_predivide_factor: Annotated[float, number(0.0, lo_open=True)] = key(
        1.0, "gradient_predivide_factor", note="zero.reduce"
    )
    gradient_allreduce_op: Annotated[str, choice("mean", "sum")] = key(
        "mean", "gradient_allreduce_op", note="zero.reduce"
    )
    seed: Annotated[int | None, optional(integer(0))] = key(None, "seed", note="initialize")
    # DeepSpeed's default is true; hybridzero refuses a client optimizer under optimizer offload only when it is set
    # explicitly (its DeepSpeedCPUAdam is torch's Adam, so a client optimizer costs nothing extra here)
    zero_force_ds_cpu_optimizer: Annotated[bool | None, optional(boolean)] = key(
        None, "zero_force_ds_cpu_optimizer", note="initialize (ZeRORuntimeException)"
    )
    # hybridzero extension: a step whose gradients hold inf/nan on any rank is skipped on every rank, in any dtype
    skip_nonfinite_steps: Annotated[bool, boolean] = key(False, "skip_nonfinite_steps", note="engine.step")
    # Ulysses sequence parallelism (runtime.sequence_parallel): groups of s consecutive ranks share each sample
    sequence_parallel_size: Annotated[int, integer(1)] = key(
        1, "sequence_parallel_size", note="runtime.sequence_parallel"
    )
    world_size: int = 1  # not a JSON key: the world size (batch sizes are resolved against world_size / s)
    _raw: dict[str, Any] = PrivateAttr(default_factory=dict)

    @classmethod
    def _translate(cls, data: dict[str, Any]) -> dict[str, Any]:
        for name in _BLOCKS:
            if name in data and data[name] is None:  # null block: the defaults
                del data[name]
        if isinstance(data.get("zero_optimization"), bool):  # DeepSpeed's deprecated form: true means stage 1
            data["zero_optimization"] = {"stage": int(data["zero_optimization"])}
        known = spellings(cls)
        unknown = [k for k in data if k not in known and k not in cls.model_fields]  # field names: direct use
        if unknown:  # before the batch arithmetic: a misspelt batch key is named, not reported as missing
            raise unknown_key_error("", unknown[0], known)
        world = _world_size(data.get("world_size", 1))
        tbs, micro, gas = (_batch_value(data.get(k)) for k in BATCH_KEYS)
        sizes = resolve_batch_sizes(tbs, micro, gas, world_size=world // _sp_size(data, world))
        data.update(zip(BATCH_KEYS, sizes))
        return data

    @model_validator(mode="after")
    def _contradictions(self) -> Config:
        if self.fp16.enabled and self.bf16.enabled:
            raise ConfigError(
                "fp16.enabled = true and bf16.enabled = true: at most one reduced precision can be "
                "enabled; set one of them to false",
                key="bf16.enabled",
                value=True,
            )
        _must_divide(self.world_size, self.zero.hpz_partition_size, "zero_optimization.zero_hpz_partition_size", "")
        _check_allgather_bucket(self.zero.stage, self.zero.allgather_bucket_size)
        _must_divide(
            self.world_size,
            self.hybrid_engine.inference_tp_size,
            "hybrid_engine.inference_tp_size",
            f" (groups of {self.hybrid_engine.inference_tp_size} consecutive ranks generate together)",
        )
        return self

    @property
    def compute_dtype(self) -> torch.dtype:
        """Training compute dtype: bf16 or fp16 when enabled, else fp32."""
        if self.bf16.enabled:
            return torch.bfloat16
        return torch.float16 if self.fp16.enabled else torch.float32

    @property
    def communication_dtype(self) -> torch.dtype:
        """Gradient-communication dtype: ``communication_data_type`` or, unset, the compute dtype."""
        by_name = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
        return by_name[self.communication_data_type] if self.communication_data_type else self.compute_dtype

    @property
    def dp_world_size(self) -> int:
        """Data-parallel world size the batch sizes were resolved against (``world_size / sequence_parallel_size``:
        the ranks of one sequence-parallel group read the same samples)."""
        return self.world_size // self.sequence_parallel_size

    @property
    def raw(self) -> Mapping[str, Any]:
        """A deep read-only view of the JSON this config was loaded from (empty when built directly)."""
        return freeze(self._raw)

    def get(self, key: str, default: Any = None) -> Any:
        """``raw.get(key, default)``: DeepSpeed's ``engine.config`` is the JSON dict, and integrations read it so
        (transformers' ``engine.config.get("zero_optimization", {})``)."""
        return self.raw.get(key, default)

    def raw_dict(self) -> dict[str, Any]:
        """A mutable, JSON-serialisable copy of ``raw``."""
        return thaw(self._raw)

    def with_raw(self, raw: Mapping[str, Any]) -> Config:
        """This config remembering ``raw`` (a deep copy) as the JSON it came from; ``load_config`` calls it once,
        before anyone else sees the config (a second call is an error: a config never changes)."""
        if self._raw:
            raise TypeError("Config.raw is set once, by load_config")
        self._raw = thaw(raw)
        return self


def _sp_size(data: dict[str, Any], world: int) -> int:
    """``sequence_parallel_size`` of the raw config once it is a valid divisor of ``world`` (else 1: the field's own
    validation reports a bad type or value; a non-divisor is reported here, before the batch arithmetic uses it)."""
    size = data.get("sequence_parallel_size", 1)
    if isinstance(size, float) and size.is_integer():
        size = int(size)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        return 1
    _must_divide(world, size, "sequence_parallel_size", f" (groups of {size} consecutive ranks share each sequence)")
    return size


def _check_allgather_bucket(stage: int, size: int) -> None:
    """DeepSpeed's ZeRO 1/2 optimizer asserts ``allgather_bucket_size`` is a multiple of its partition alignment;
    so does this (a :class:`ConfigAssertionError`, also an ``AssertionError`` as DeepSpeed's)."""
    factor = NCCL_START_ALIGNMENT_FACTOR
    if stage in (1, 2) and size % factor:
        raise ConfigAssertionError(
            f"zero_optimization.allgather_bucket_size = {size} is invalid at stage {stage}: allgather_bucket_size "
            f"must be a multiple of nccl_start_alignment_factor ({factor}), as DeepSpeed asserts; use "
            f"{size - size % factor or factor}",
            key="zero_optimization.allgather_bucket_size",
            value=size,
        )


def _must_divide(world_size: int, size: int, key: str, why: str) -> None:
    """Raise :class:`ConfigError` naming ``key`` and the valid values unless ``size`` divides ``world_size``."""
    if world_size % size:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ConfigError(
            f"{key} = {size} does not divide world_size = {world_size}{why}; valid values: "
            f"{', '.join(map(str, divisors))}",
            key=key,
            value=size,
        )

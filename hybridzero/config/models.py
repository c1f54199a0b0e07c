"""The blocks of the DeepSpeed JSON below the top level: ``zero_optimization`` (with its offload blocks), ``fp16``,
``bf16`` and ``hybrid_engine``.

Every accepted key is either a typed field (``acts=False`` on the ones hybridzero does not act on) or listed in the
block's ``_ignored`` set; both kinds without effect warn once by name (:mod:`.load`). Defaults are DeepSpeed's
effective defaults; the deliberate differences (bucket sizes must be >= 1; ``offload_param`` needs stage 3, its
``nvme`` an ``nvme`` optimizer) are noted where they occur.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Any, ClassVar

from pydantic import model_validator

from .base import Block
from .errors import show
from .values import BlockProblem, boolean, choice, integer, key, number, optional, text, texts

__all__ = [
    "DEFAULT_LEAF_MODULE_CLASSES",
    "BF16Config",
    "FP16Config",
    "HybridEngineConfig",
    "LeafModuleConfig",
    "OffloadConfig",
    "ParamOffloadConfig",
    "ZeroConfig",
]

_SIZE = Annotated[int, integer(0)]  # element counts may be 0
_BUCKET = Annotated[int, integer(1)]  # a 0-element bucket never fills


class OffloadConfig(Block):
    """One ``zero_optimization.offload_*`` block (acts through :mod:`hybridzero.zero.offload` and
    :mod:`hybridzero.optim.swap`).

    Invariants: ``device`` is ``none``, ``cpu`` or ``nvme``; ``nvme`` needs ``nvme_path``; ``buffer_count >= 1``
    (chunks of optimizer state in flight between the swap files and memory). Rules across the two blocks and the
    stage live on :class:`ZeroConfig`.
    """

    _prefix: ClassVar[str] = "offload"
    _ignored: ClassVar[frozenset[str]] = frozenset(
        {
            "buffer_size",
            "max_in_cpu",
            "pipeline_read",
            "pipeline_write",
            "fast_init",
            "ratio",
            "nvme_path_per_local_rank",
            "super_offload",
            "cpuadam_cores_perc",
        }
    )

    device: Annotated[str, choice("none", "cpu", "nvme")] = key("none", "device", note="zero.offload")
    pin_memory: Annotated[bool, boolean] = key(False, "pin_memory", note="zero.offload (CUDA only)")
    nvme_path: Annotated[str | None, optional(text)] = key(None, "nvme_path", note="optim.swap")
    buffer_count: Annotated[int, integer(1)] = key(4, "buffer_count", note="optim.swap (chunks in flight)")

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> OffloadConfig:
        if self.device == "nvme" and not self.nvme_path:
            raise BlockProblem(
                "{0} = 'nvme' needs {1}: a directory on a fast local disk for the swap files",
                ("device", "nvme_path"),
                self.device,
            )
        return self

    @property
    def enabled(self) -> bool:
        """True when something is offloaded."""
        return self.device != "none"


class ParamOffloadConfig(OffloadConfig):
    """``zero_optimization.offload_param``: as :class:`OffloadConfig`; with ``device: nvme`` (which needs
    ``offload_optimizer.device: nvme``, see :class:`ZeroConfig`) the ZeRO-3 compute shards live in files under
    ``nvme_path`` and are read in for each gather, ``buffer_count`` shards read ahead at most, holding at most
    ``max_in_cpu`` elements (DeepSpeed's default 1e9) in those read-ahead buffers."""

    _ignored: ClassVar[frozenset[str]] = OffloadConfig._ignored - {"max_in_cpu"}

    nvme_path: Annotated[str | None, optional(text)] = key(None, "nvme_path", note="optim.swap_master (params.bin)")
    buffer_count: Annotated[int, integer(1)] = key(5, "buffer_count", note="optim.swapfile (shards read ahead)")
    max_in_cpu: Annotated[int, integer(0)] = key(
        1_000_000_000, "max_in_cpu", note="optim.swapfile (elements read ahead)"
    )


DEFAULT_LEAF_MODULE_CLASSES: tuple[str, ...] = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)
"""DeepSpeed's default ZeRO-3 leaf classes: the sparse MoE blocks of Mixtral, Qwen2-MoE and Qwen3-MoE."""


class LeafModuleConfig(Block):
    """``zero_optimization.leaf_module``: modules made ZeRO-3 leaves at ``initialize`` (gathered as one unit around
    their forward, :mod:`hybridzero.zero.leaf`), chosen by class (short or fully qualified name), by qualified
    module name, or by name suffix. A lone string means a one-element list; repeats are dropped. Lists, as
    DeepSpeed's model has them (compared with lists by DeepSpeed users)."""

    _prefix: ClassVar[str] = "leaf_module"

    classes: Annotated[list[str], texts()] = key(list(DEFAULT_LEAF_MODULE_CLASSES), "classes", note="zero.leaf")
    names: Annotated[list[str], texts()] = key([], "names", note="zero.leaf")
    name_suffixes: Annotated[list[str], texts()] = key([], "name_suffixes", note="zero.leaf")


class ZeroConfig(Block):
    """The ``zero_optimization`` block.

    Invariants: ``0 <= stage <= 3``; sizes/thresholds are ints >= 0 and bucket sizes ints >= 1 (elements, not
    bytes); ``hpz_partition_size >= 1``; ``overlap_comm`` is a bool -- omitted or ``null`` gives DeepSpeed's
    effective default, ``stage == 3``. The deprecated booleans ``cpu_offload`` / ``cpu_offload_param`` mean an
    offload block with device ``cpu``. ``offload_param`` acts only at stage 3; with the optimizer on the device its
    ``cpu`` keeps each compute-dtype shard on the host (re-cast from the master after every write); its ``nvme``
    needs the optimizer's ``nvme`` (the compute shards go to files with the masters they are cast from).
    """

    _prefix: ClassVar[str] = "zero_optimization"
    _ignored: ClassVar[frozenset[str]] = frozenset(
        {
            "allgather_partitions",
            "use_multi_rank_bucket_allreduce",
            "load_from_fp32_weights",
            "elastic_checkpoint",
            "round_robin_gradients",
            "legacy_stage1",
            "grad_hooks",
            "cpu_offload_use_pin_memory",
            "stage3_model_persistence_threshold",
            "model_persistence_threshold",
            "stage3_module_granularity_threshold",
            "module_granularity_threshold",
            "stage3_use_all_reduce_for_fetch_params",
            "use_all_reduce_for_fetch_params",
            "stage3_allgather_sequential",
            "allgather_sequential",
            "zeropp_loco_param",
            "mics_shard_size",
            "mics_hierarchical_params_gather",
            "memory_efficient_linear",
            "pipeline_loading_checkpoint",
            "override_module_apply",
            "log_trace_cache_warnings",
            "enable_sanity_checks",
            "save_muon_momentum_buffer_in_memory",
            "zenflow",
            "compute_grad_norm",
            "parameter_alignment",
        }
    )

    stage: Annotated[int, integer(0, 3)] = key(0, "stage")
    prefetch_bucket_size: _SIZE = key(50_000_000, "stage3_prefetch_bucket_size", "prefetch_bucket_size", auto=True)
    param_persistence_threshold: _SIZE = key(
        100_000, "stage3_param_persistence_threshold", "param_persistence_threshold", auto=True
    )
    max_live_parameters: _SIZE = key(1_000_000_000, "stage3_max_live_parameters", "max_live_parameters", auto=True)
    max_reuse_distance: _SIZE = key(1_000_000_000, "stage3_max_reuse_distance", "max_reuse_distance", auto=True)
    reduce_bucket_size: _BUCKET = key(500_000_000, "reduce_bucket_size", auto=True)
    allgather_bucket_size: _BUCKET = key(500_000_000, "allgather_bucket_size", auto=True, acts=False)
    overlap_comm: Annotated[bool, boolean] = key(False, "overlap_comm")
    contiguous_gradients: Annotated[bool, boolean] = key(True, "contiguous_gradients", acts=False)
    reduce_scatter: Annotated[bool, boolean] = key(True, "reduce_scatter", acts=False)
    sub_group_size: _BUCKET = key(1_000_000_000, "sub_group_size", auto=True, note="optim.swap (nvme chunks)")
    hpz_partition_size: Annotated[int, integer(1)] = key(1, "zero_hpz_partition_size")
    quantized_weights: Annotated[bool, boolean] = key(False, "zero_quantized_weights")
    quantized_gradients: Annotated[bool, boolean] = key(False, "zero_quantized_gradients")
    quantized_nontrainable_weights: Annotated[bool, boolean] = key(False, "zero_quantized_nontrainable_weights")
    # hybridzero extensions (not DeepSpeed keys): the qwZ/qgZ block size and the qgZ bit width (8, or 4)
    quantization_block_size: Annotated[int, integer(2)] = key(2048, "zero_quantization_block_size")
    quantized_gradients_bits: Annotated[int, integer(4, 8)] = key(8, "zero_quantized_gradients_bits")
    offload_optimizer: OffloadConfig = key(OffloadConfig(), "offload_optimizer")
    offload_param: ParamOffloadConfig = key(ParamOffloadConfig(), "offload_param")
    leaf_module: LeafModuleConfig = key(LeafModuleConfig(), "leaf_module")
    # acts through engine.save_16bit_model (consolidated 16-bit weights on save)
    gather_16bit_weights_on_model_save: Annotated[bool, boolean] = key(
        False,
        "stage3_gather_16bit_weights_on_model_save",
        "gather_16bit_weights_on_model_save",
        deprecated=("stage3_gather_fp16_weights_on_model_save",),
        note="engine.save_16bit_model",
    )
    # DeepSpeed's default true; false raises at stages 1 and 2 on a trainable parameter with no gradient
    ignore_unused_parameters: Annotated[bool, boolean] = key(
        True, "ignore_unused_parameters", note="zero.coordinator (stages 1/2)"
    )

    _legacy: ClassVar[Mapping[str, str]] = MappingProxyType(
        {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}
    )

    @classmethod
    def _translate(cls, data: dict[str, Any]) -> dict[str, Any]:
        for name in ("offload_optimizer", "offload_param"):
            if name in data and data[name] is None:  # null block: the defaults
                del data[name]
        if data.get("overlap_comm") is None:
            data["overlap_comm"] = data.get("stage") == 3
        for legacy, new in cls._legacy.items():
            if legacy not in data:
                continue
            if new in data:
                raise BlockProblem("'{0}' (deprecated) and '{1}' are both set; give only '{1}'", (legacy, new))
            value = data.pop(legacy)
            if not isinstance(value, bool):
                shown = show(value).replace("{", "{{").replace("}", "}}")  # the template's own braces stay
                raise BlockProblem(f"{{0}} = {shown} is invalid: expected true or false", (legacy,), value)
            if value:
                data[new] = {"device": "cpu"}
        return data

    @model_validator(mode="after")
    def _offload_rules(self) -> ZeroConfig:
        param, opt = self.offload_param, self.offload_optimizer
        if opt.enabled and self.stage == 0:
            raise BlockProblem(
                f"{{0}}.device = {opt.device!r} needs stage 1, 2 or 3 (ZeRO-Offload moves the "
                f"optimizer's shard), got {{1}} = 0; use stage >= 1 or device 'none'",
                ("offload_optimizer", "stage"),
                opt.device,
            )
        if param.enabled and self.stage != 3:
            raise BlockProblem(
                f"{{0}}.device = {param.device!r} needs stage 3 (parameters are only sharded at "
                f"stage 3), got {{1}} = {self.stage}; use stage 3 or device 'none'",
                ("offload_param", "stage"),
                param.device,
            )
        if param.device == "nvme" and opt.device != "nvme":
            raise BlockProblem(
                f"{{0}}.device = 'nvme' needs {{1}}.device 'nvme' in hybridzero (got {opt.device!r}): the compute "
                f"shards go to files together with the fp32 master they are cast from",
                ("offload_param", "offload_optimizer"),
                param.device,
            )
        return self


class FP16Config(Block):
    """The ``fp16`` block (DeepSpeed's defaults: dynamic scaling from 2**16).

    Invariants: ``loss_scale >= 0`` (0 = dynamic); with fp16 enabled and dynamic scaling, ``loss_scale_window >= 1``,
    ``hysteresis >= 1`` and ``min_loss_scale > 0`` (DeepSpeed only checks these when they take effect).
    """

    _prefix: ClassVar[str] = "fp16"
    _ignored: ClassVar[frozenset[str]] = frozenset({"auto_cast", "fp16_master_weights_and_grads"})

    enabled: Annotated[bool, boolean] = key(False, "enabled")
    loss_scale: Annotated[float, number(0.0)] = key(0.0, "loss_scale")
    initial_scale_power: Annotated[int, integer(0, 64)] = key(16, "initial_scale_power")
    loss_scale_window: Annotated[int, integer()] = key(1000, "loss_scale_window")
    hysteresis: Annotated[int, integer()] = key(2, "hysteresis")
    consecutive_hysteresis: Annotated[bool, boolean] = key(False, "consecutive_hysteresis")
    min_loss_scale: Annotated[float, number()] = key(1.0, "min_loss_scale")

    @model_validator(mode="after")
    def _check_dynamic_scaling(self) -> FP16Config:
        if not self.dynamic_loss_scale:
            return self
        rules = (
            ("loss_scale_window", self.loss_scale_window >= 1, "an integer >= 1"),
            ("hysteresis", self.hysteresis >= 1, "an integer >= 1"),
            ("min_loss_scale", self.min_loss_scale > 0, "a number > 0"),
        )
        for name, ok, expected in rules:
            if not ok:
                value = getattr(self, name)
                raise BlockProblem(
                    f"{{0}} = {value!r} is invalid with dynamic loss scaling ({{1}} = 0): expected {expected}",
                    (name, "loss_scale"),
                    value,
                )
        return self

    @property
    def dynamic_loss_scale(self) -> bool:
        """True when fp16 is on and the loss scale is dynamic (``loss_scale == 0``)."""
        return self.enabled and self.loss_scale == 0.0

    @property
    def initial_loss_scale(self) -> float:
        """The scale training starts at: ``2**initial_scale_power`` if dynamic, else ``loss_scale``."""
        return float(2**self.initial_scale_power) if self.loss_scale == 0.0 else self.loss_scale


class BF16Config(Block):
    """The ``bf16`` block (legacy spelling ``bfloat16``). bf16 needs no loss scaling."""

    _prefix: ClassVar[str] = "bf16"
    _ignored: ClassVar[frozenset[str]] = frozenset(
        {"immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads", "bf16_optimizer_states"}
    )

    enabled: Annotated[bool, boolean] = key(False, "enabled")


class HybridEngineConfig(Block):
    """The ``hybrid_engine`` block (train <-> generate switching).

    Invariants: ``max_out_tokens >= 1``; ``inference_tp_size >= 1`` (and it divides the world size: checked by
    :class:`~hybridzero.config.schema.Config`); ``tp_gather_partition_size >= 1``. ``max_out_tokens``,
    ``inference_tp_size`` (tensor-parallel generation, :mod:`hybridzero.runtime.tp_generate`) and
    ``tp_gather_partition_size`` (how many layers are gathered at once while the tensor-parallel copies are cut,
    DeepSpeed's meaning) act; ``rollout_engine`` (hybridzero's: ``hf`` or ``vllm``) picks the RL trainers' rollout
    engine (:mod:`hybridzero.rlhf.rollout.backends`): ``engine.generate`` works whether ``enabled`` is set or not,
    and the other keys tune DeepSpeed's inference kernels, which hybridzero does not use.
    """

    _prefix: ClassVar[str] = "hybrid_engine"

    enabled: Annotated[bool, boolean] = key(False, "enabled", acts=False)
    max_out_tokens: Annotated[int, integer(1)] = key(512, "max_out_tokens", note="runtime.hybrid")
    inference_tp_size: Annotated[int, integer(1)] = key(1, "inference_tp_size", note="runtime.tp_generate")
    release_inference_cache: Annotated[bool, boolean] = key(False, "release_inference_cache", acts=False)
    pin_parameters: Annotated[bool, boolean] = key(True, "pin_parameters", acts=False)
    tp_gather_partition_size: Annotated[int, integer(1)] = key(8, "tp_gather_partition_size", note="runtime.tp_swap")
    rollout_engine: Annotated[str, choice("hf", "vllm")] = key(
        "hf", "rollout_engine", note="rlhf.rollout.backends (read by the RL trainers; engine.generate is always hf)"
    )

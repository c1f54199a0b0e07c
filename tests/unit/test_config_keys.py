"""Every key the config accepts either acts or warns once by name -- proven over the whole list, derived from the
models (``hybridzero.config.accepted_keys``), not from a hand list.

* A key that acts is listed in :data:`ACTS` with the test that shows its effect (checked to exist); set to its
  default it loads without any warning.
* A key without effect warns exactly once, naming the dotted key and saying it has no effect in hybridzero.
* Other spellings: aliases are silent, deprecated spellings warn once that they are deprecated.
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path
from typing import Any

import pytest

from hybridzero.config import AcceptedKey, Config, ConfigError, accepted_keys, load_config
from hybridzero.config.base import Block, child_model, spellings
from hybridzero.config.optim import OPTIMIZER_PARAMS, SCHEDULER_PARAMS
from hybridzero.config.schema import NCCL_START_ALIGNMENT_FACTOR
from hybridzero.zero.layout import PARTITION_ALIGN
from hybridzero.zero.reduce import ReductionScales, reduction_scales

_TESTS = Path(__file__).resolve().parents[1]
_MAPPING = "unit/test_config.py::test_key_mapping"
_BATCH = "unit/test_config.py::test_resolve_batch_sizes"
_PARITY = "distributed/test_zero3_parity.py::test_parity_accumulation_clipping_optimizers"
_PREFETCH = "distributed/test_zero3_invariants.py::test_prefetch_off_small_large_bitwise_identical"
_REUSE = "distributed/test_zero3_invariants.py::test_reuse_rule_gathers_once_per_step_with_identical_results"
_ZEROPP = "distributed/test_zeropp_quantized.py::test_quantized_collectives_tiny_model"
_FP16 = "distributed/test_fp16.py::test_overflow_on_one_rank_skips_everywhere_with_hysteresis"
_REDUCE = "distributed/test_reduction_options.py::test_allreduce_op_prescale_and_predivide_against_reference"
_OPTIM = "unit/test_optim.py::test_invalid_adam_params"
_SCHED = "unit/test_schedulers.py::test_invalid_params_name_key_and_value"
_OFFLOAD = "distributed/test_offload.py::test_offload_is_bitwise_identical"
_OFFLOAD_MAP = "unit/test_config.py::test_offload_optimizer_mapping"
_FORCED_CPU_OPTIM = "unit/test_ds_alias_names.py::test_forced_cpu_optimizer_raises_zero_runtime_exception"
_LEAF = "unit/test_ds_alias_names.py::test_leaf_module_config_block"
_OFFLOAD_PARAM = "distributed/test_offload.py::test_offload_param_at_stage_3_is_bitwise_identical"
_READ_AHEAD = "unit/test_swapfile.py::test_read_ahead_is_bounded_by_buffer_count_and_max_in_cpu"
_PROGRESS = "distributed/test_reduction_options.py::test_steps_per_print_logs_progress_every_n_steps_on_rank_0"

# canonical key -> the test that shows its effect (a group shares one)
ACTS: dict[str, str] = {
    "activation_checkpointing": "unit/test_activation_checkpointing.py::test_settings_from_the_block_then_arguments",
    "tensorboard": "unit/test_monitor.py::test_tensorboard_writes_event_files",
    "csv_monitor": "unit/test_monitor.py::test_csv_monitor_writes_one_file_per_event",
    "wandb": "unit/test_monitor.py::test_wandb_offline_run_holds_the_events",
    "comet": "unit/test_monitor.py::test_comet_offline_experiment_holds_the_events",
    "train_batch_size": _BATCH,
    "train_micro_batch_size_per_gpu": _BATCH,
    "gradient_accumulation_steps": _PARITY,
    "gradient_clipping": _PARITY,
    "communication_data_type": "unit/test_config.py::test_compute_and_communication_dtype",
    "seed": _MAPPING,  # runtime.initialize seeds torch with it
    "steps_per_print": _PROGRESS,
    "skip_nonfinite_steps": _MAPPING,  # typed field; the engine's step implements it (another slice)
    "sequence_parallel_size": _MAPPING,  # typed field; runtime.sequence_parallel, distributed/test_sequence_parallel
    "prescale_gradients": _REDUCE,
    "gradient_predivide_factor": _REDUCE,
    "gradient_allreduce_op": _REDUCE,
    "zero_optimization": _PARITY,
    "zero_optimization.stage": "distributed/test_stages.py::test_stage_parity",
    "zero_optimization.stage3_prefetch_bucket_size": _PREFETCH,
    "zero_optimization.stage3_param_persistence_threshold": _PARITY,
    "zero_optimization.stage3_max_live_parameters": _REUSE,
    "zero_optimization.stage3_max_reuse_distance": _REUSE,
    "zero_optimization.reduce_bucket_size": _PREFETCH,
    "zero_optimization.overlap_comm": _PREFETCH,
    "zero_optimization.zero_hpz_partition_size": "distributed/test_hpz.py::test_hpz_sizes_are_bitwise_identical",
    "zero_optimization.zero_quantized_weights": _ZEROPP,
    "zero_optimization.zero_quantized_gradients": _ZEROPP,
    "zero_optimization.zero_quantized_nontrainable_weights": _ZEROPP,
    "zero_optimization.zero_quantization_block_size": _ZEROPP,
    "zero_optimization.zero_quantized_gradients_bits": _ZEROPP,
    # offload (zero.offload / optim.swap): bitwise-identical runs with the state on the host or in swap files
    "zero_optimization.offload_optimizer": _OFFLOAD,
    "zero_optimization.offload_optimizer.device": _OFFLOAD,
    "zero_optimization.offload_optimizer.nvme_path": _OFFLOAD,
    "zero_optimization.offload_optimizer.buffer_count": _OFFLOAD,
    "zero_optimization.sub_group_size": _OFFLOAD,
    "zero_optimization.cpu_offload": _OFFLOAD_MAP,
    # pin_memory pins the host buffers (CUDA only; on a CPU-only machine host and device are one)
    "zero_optimization.offload_optimizer.pin_memory": _OFFLOAD_MAP,
    "zero_optimization.offload_param.pin_memory": _MAPPING,
    "zero_optimization.leaf_module": _LEAF,
    "zero_optimization.leaf_module.classes": _LEAF,
    "zero_optimization.leaf_module.names": _LEAF,
    "zero_optimization.leaf_module.name_suffixes": _LEAF,
    "zero_force_ds_cpu_optimizer": _FORCED_CPU_OPTIM,
    "zero_optimization.offload_param": _OFFLOAD_PARAM,
    "zero_optimization.offload_param.device": _OFFLOAD_PARAM,
    "zero_optimization.offload_param.nvme_path": _OFFLOAD_PARAM,
    "zero_optimization.offload_param.buffer_count": _READ_AHEAD,
    "zero_optimization.offload_param.max_in_cpu": _READ_AHEAD,
    "zero_optimization.cpu_offload_param": "unit/test_config_errors.py::test_bad_values_name_key_and_value",
    # acts through engine.save_16bit_model (another slice)
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": _MAPPING,
    "zero_optimization.ignore_unused_parameters": (
        "distributed/test_reduction_options.py::test_ignore_unused_parameters_false_raises_at_stages_1_and_2"
    ),
    "fp16": _FP16,
    "fp16.enabled": _FP16,
    "fp16.loss_scale": _FP16,
    "fp16.initial_scale_power": _FP16,
    "fp16.loss_scale_window": _FP16,
    "fp16.hysteresis": _FP16,
    "fp16.consecutive_hysteresis": _FP16,
    "fp16.min_loss_scale": _FP16,
    "bf16": "distributed/test_zero3_invariants.py::test_bf16_tracks_fp32_reference",
    "bf16.enabled": "distributed/test_zero3_invariants.py::test_bf16_tracks_fp32_reference",
    "hybrid_engine": "distributed/test_hybrid_engine.py::test_generation_matches_unsharded",
    "hybrid_engine.max_out_tokens": "distributed/test_hybrid_engine.py::test_generation_matches_unsharded",
    "hybrid_engine.inference_tp_size": "distributed/test_tp_generation.py::test_tp_generation_matches_whole_model",
    # how many layers are gathered at once while the tensor-parallel copies are cut (the peak bytes show it)
    "hybrid_engine.tp_gather_partition_size": (
        "distributed/test_tp_generation.py::test_tp_generation_matches_whole_model"
    ),
    # the RL trainers read the actor's key to pick their rollout engine (vLLM weight syncs show it)
    "hybrid_engine.rollout_engine": "distributed/test_rlhf_vllm.py::test_grpo_at_world_2_on_vllm",
    "optimizer": _OPTIM,
    "optimizer.type": "unit/test_optim.py::test_type_names_are_case_insensitive_like_deepspeed",
    "optimizer.params": _OPTIM,
    "scheduler": _SCHED,
    "scheduler.type": _SCHED,
    "scheduler.params": _SCHED,
}
# every optimizer / scheduler param that acts is passed to the constructor it names
_PARAM_EVIDENCE = {"optimizer.params": _OPTIM, "scheduler.params": _SCHED}
_SAMPLES: dict[str, Any] = {
    "scheduler.params.total_num_steps": 10,
    "scheduler.params.cycle_min_lr": 0.01,  # OneCycle's two required bounds (their default, None, is refused)
    "scheduler.params.cycle_max_lr": 0.1,
    "train_batch_size": 1,
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "optimizer.type": "adam",
    "scheduler.type": "warmupdecaylr",
}


def _evidence(key: AcceptedKey) -> str:
    prefix = key.path.rpartition(".")[0]
    return _PARAM_EVIDENCE[prefix] if key.types else ACTS[key.canonical]


def _field(path: str, types: tuple[str, ...]) -> Any:
    """The pydantic field of a dotted key (None for keys in an ``_ignored`` set or legacy spellings)."""
    parts = path.split(".")
    cls: type[Block] = Config
    if types:
        cls = (OPTIMIZER_PARAMS if parts[0] == "optimizer" else SCHEDULER_PARAMS)[types[0]]
        parts = parts[2:]
    for part in parts[:-1]:
        child = child_model(cls, part)
        assert child is not None, path
        cls = child
    name = spellings(cls).get(parts[-1])
    return cls.model_fields[name] if name and name in cls.model_fields else None


def _sample(key: AcceptedKey) -> Any:
    """A valid value: the field's default (``{}`` for a block), or ``False`` for an untyped ignored key."""
    if key.path in _SAMPLES:
        return _SAMPLES[key.path]
    field = _field(key.path, key.types)
    if field is None or key.spelling == "legacy":
        return False
    default = field.default
    return {} if isinstance(default, Block) or default is None and key.path in ("optimizer", "scheduler") else default


def _document(key: AcceptedKey, value: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
    first = key.path.split(".")[0]
    if first == "optimizer":
        doc["optimizer"] = {"type": key.types[0] if key.types else "Adam"}
    if first == "scheduler":
        type_ = key.types[0] if key.types else "WarmupDecayLR"
        required: dict[str, dict[str, Any]] = {
            "WarmupLR": {},
            "LRRangeTest": {},
            "OneCycle": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1},
        }
        doc["scheduler"] = {"type": type_, "params": required.get(type_, {"total_num_steps": 10})}
    node = doc
    parts = key.path.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    if value == {} and isinstance(node.get(parts[-1]), dict):
        return doc  # the block is already there
    node[parts[-1]] = value
    return doc


def _messages(doc: dict[str, Any]) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(doc, 1)
    return [str(w.message) for w in caught]


KEYS = accepted_keys()


def test_the_walk_covers_every_block_and_the_acts_table_matches_the_models() -> None:
    canonical_acting = {k.path for k in KEYS if k.acts and not k.types and k.spelling in ("canonical", "legacy")}
    assert canonical_acting == set(ACTS), canonical_acting ^ set(ACTS)
    for block in (
        "zero_optimization",
        "zero_optimization.offload_param",
        "fp16",
        "bf16",
        "hybrid_engine",
        "optimizer.params",
        "scheduler.params",
    ):
        assert any(k.path.startswith(block + ".") for k in KEYS), block
    assert len(KEYS) > 150  # DeepSpeed's surface, not a sample of it


@pytest.mark.parametrize("key", KEYS, ids=lambda k: f"{k.path}[{','.join(k.types)}]")
def test_every_accepted_key_acts_or_warns_once(key: AcceptedKey) -> None:
    messages = _messages(_document(key, _sample(key)))
    if key.spelling in ("deprecated", "legacy"):
        assert len(messages) == 1 and f"'{key.path}'" in messages[0] and "deprecated" in messages[0], messages
    elif key.acts:
        assert messages == [], messages
        file, _, name = _evidence(key).partition("::")
        tree = ast.parse((_TESTS / file).read_text())
        assert name in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, _evidence(key)
    else:
        assert len(messages) == 1, messages
        assert f"config key '{key.path}' is accepted for DeepSpeed compatibility but has no effect" in messages[0]


def test_cheap_effects() -> None:
    """One line per group where the effect is visible without running an engine."""

    def cfg(extra: dict[str, Any], world: int = 4) -> Config:
        return load_config({"train_micro_batch_size_per_gpu": 1, **extra}, world)

    def scales(c: Config) -> ReductionScales:
        return reduction_scales(c.gradient_allreduce_op, c.prescale_gradients, c.gradient_predivide_factor, 4)

    assert scales(cfg({})) == ReductionScales(pre=None, post=4.0)  # mean: the sum divided by W once
    assert scales(cfg({"gradient_allreduce_op": "sum"})) == ReductionScales()
    assert scales(cfg({"prescale_gradients": True})) == ReductionScales(pre=4.0)
    assert scales(cfg({"gradient_predivide_factor": 2})) == ReductionScales(pre=2.0, post=2.0)
    # sum: DeepSpeed divides only when averaging; prescale and predivide are ignored (and warned about)
    assert scales(cfg({"gradient_allreduce_op": "sum", "gradient_predivide_factor": 2})) == ReductionScales()
    assert scales(cfg({"gradient_allreduce_op": "sum", "prescale_gradients": True})) == ReductionScales()
    assert cfg({"skip_nonfinite_steps": True}).skip_nonfinite_steps is True
    assert (
        cfg(
            {"zero_optimization": {"stage3_gather_16bit_weights_on_model_save": True}}
        ).zero.gather_16bit_weights_on_model_save
        is True
    )
    assert cfg({"seed": 7}).seed == 7


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_odd_allgather_bucket_size_is_rejected_at_stages_1_2(stage: int) -> None:
    """DeepSpeed's ZeRO 1/2 optimizer asserts ``allgather_bucket_size`` is a multiple of its partition alignment
    (2 elements, which hybridzero's layout pads partitions to as well): an odd size at stage 1 or 2 is a config
    error that is also an ``AssertionError`` with DeepSpeed's words; at stages 0 and 3 (no such assert in DeepSpeed)
    it loads. The key has no other effect (gathers go by gather group): it warns as accepted without effect."""
    doc = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage, "allgather_bucket_size": 1001}}
    if stage in (1, 2):
        with pytest.raises(AssertionError, match="must be a multiple of nccl_start_alignment_factor") as info:
            load_config(doc, 1)
        assert isinstance(info.value, ConfigError) and info.value.key == "zero_optimization.allgather_bucket_size"
        assert "use 1000" in str(info.value)
        doc["zero_optimization"]["allgather_bucket_size"] = 1000
    messages = _messages(doc)
    assert load_config(doc, 1).zero.allgather_bucket_size in (1000, 1001)
    assert len(messages) == 1, messages
    assert "config key 'zero_optimization.allgather_bucket_size' is accepted for DeepSpeed compatibility" in messages[0]


def test_partition_alignment_is_deepspeeds_factor() -> None:
    """The layout pads every partition to the alignment the config validates against (DeepSpeed's 2 elements)."""
    assert PARTITION_ALIGN == NCCL_START_ALIGNMENT_FACTOR == 2

"""DeepSpeed keys hybridzero accepts but does not act on (yet).

A key listed here loads with one ``UserWarning`` naming it; a key that is
neither listed here nor mapped onto a typed field is an error. Lists come from
DeepSpeed's config documentation and its config models (``runtime/config.py``,
``runtime/constants.py``, ``runtime/zero/config.py``, ``zero/offload_config.py``,
``runtime/precision_config.py``). Everything here is an immutable frozenset.
"""

from __future__ import annotations

__all__ = [
    "BF16_IGNORED",
    "FP16_IGNORED",
    "OFFLOAD_OPTIMIZER_IGNORED",
    "OFFLOAD_PARAM_IGNORED",
    "OPTIMIZER_IGNORED",
    "TOP_IGNORED",
    "ZERO_IGNORED",
]

TOP_IGNORED: frozenset[str] = frozenset(
    {
        # optimizer plumbing
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
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
        "gradient_allreduce_op",
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

ZERO_IGNORED: frozenset[str] = frozenset(
    {
        "allgather_partitions",
        "use_multi_rank_bucket_allreduce",
        "load_from_fp32_weights",
        "elastic_checkpoint",
        "round_robin_gradients",
        "ignore_unused_parameters",
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
        "leaf_module",
        "zenflow",
    }
)

_OFFLOAD_NVME: frozenset[str] = frozenset({"buffer_count"})

OFFLOAD_PARAM_IGNORED: frozenset[str] = _OFFLOAD_NVME | {"buffer_size", "max_in_cpu"}

OFFLOAD_OPTIMIZER_IGNORED: frozenset[str] = _OFFLOAD_NVME | {
    "pipeline_read",
    "pipeline_write",
    "fast_init",
    "ratio",
}

FP16_IGNORED: frozenset[str] = frozenset({"auto_cast", "fp16_master_weights_and_grads"})

BF16_IGNORED: frozenset[str] = frozenset(
    {"immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads", "bf16_optimizer_states"}
)

OPTIMIZER_IGNORED: frozenset[str] = frozenset({"legacy_fusion"})

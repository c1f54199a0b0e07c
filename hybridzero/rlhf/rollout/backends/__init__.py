"""Rollout engines: what generates the RL trainers' answers (DESIGN §5, docs/architecture.md "Rollouts on vLLM").

``hf`` (default): the hybrid engine / ZeRO-3 ``generate`` on the actor itself
(:func:`hybridzero.rlhf.rollout.generate.rollout`).
``vllm``: a colocated vLLM engine on each rank, or on each ``inference_tp_size`` group of ranks (:mod:`.vllm_engine`,
:mod:`.vllm_tp`), synced from the actor's shards after every update (:mod:`.weights`), with an optional truncated
importance-sampling correction (:mod:`.importance`).
"""

from __future__ import annotations

from transformers import PretrainedConfig

from hybridzero.rlhf.rollout.backends.base import (
    ROLLOUT_ENGINES,
    Generations,
    RolloutEngine,
    RolloutEngineError,
    SamplingSpec,
    SyncStats,
    check_rollout_engine,
)
from hybridzero.rlhf.rollout.backends.importance import truncated_is_weights
from hybridzero.rlhf.rollout.backends.vllm_engine import VLLMEngine, VLLMOptions
from hybridzero.rlhf.settings import PPOSettings

__all__ = [
    "ROLLOUT_ENGINES",
    "Generations",
    "RolloutEngine",
    "RolloutEngineError",
    "SamplingSpec",
    "SyncStats",
    "VLLMEngine",
    "VLLMOptions",
    "build_vllm_engine",
    "check_rollout_engine",
    "truncated_is_weights",
]


def build_vllm_engine(s: PPOSettings, hf_config: PretrainedConfig, world: int, rank: int) -> VLLMEngine:
    """The vLLM engine of this rank for a PPO / GRPO run (not started: it starts at the first weight sync)."""
    opts = VLLMOptions(
        dtype=s.vllm_dtype or s.dtype,  # the trainer recomputes every log-prob it trains on in its own dtype
        gpu_memory_utilization=s.vllm_gpu_memory_utilization,
        kv_cache_gb=s.vllm_kv_cache_gb,
        max_model_len=s.vllm_max_model_len or s.max_prompt_seq_len + s.max_answer_seq_len,
        enforce_eager=s.vllm_enforce_eager,
        sleep_mode=s.vllm_enable_sleep_mode,
        tensor_parallel_size=s.inference_tp_size,  # t > 1: one engine per group of t ranks (checked in one line)
    )
    return VLLMEngine(hf_config, opts, world, rank)

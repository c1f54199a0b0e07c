"""GRPO on colocated vLLM engines at world 2 (one spawned world, one engine per rank, started once): the run trains
with finite metrics, the engines take the actor's weights after every update (counted in the ledger, bounded to
one block's gather at a time), the tensors they hold are the trainer's (bf16, LoRA merged) bit for bit, the
importance-sampling correction is on, and a vLLM failure on one rank raises the same error on every rank with no
process left behind. Greedy equality with Hugging Face and fp32 are tests/integration/test_vllm_engine.py's."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.workers.rlhf_runs import make_model_dirs
from tests.workers.vllm_runs import vllm_grpo_run

pytest.importorskip("vllm")

ITERATIONS = 2


@pytest.mark.slow
def test_grpo_at_world_2_on_vllm(world, tmp_path: Path) -> None:
    actor, value = make_model_dirs(tmp_path / "models")  # the demo model: head size 32, which vLLM's CPU build takes
    settings = {
        "actor_model_name_or_path": actor,
        "critic_model_name_or_path": value,
        "output_dir": str(tmp_path / "run"),
        "dtype": "bf16",
        "per_device_generation_batch_size": 4,
        "per_device_training_batch_size": 2,
        "group_size": 2,
        "max_prompt_seq_len": 8,
        "max_answer_seq_len": 6,
        "actor_learning_rate": 3e-3,
        "actor_lora_dim": 3,
        "actor_lora_module_name": "layers.",
        "reward_funcs": ["tests.workers.rlvr_rewards:digit_share"],
        "reward_model": False,
        "progress": False,
        "enable_tensorboard": False,
        "resume": False,
        "seed": 5,
        "rollout_engine": "vllm",
        "vllm_kv_cache_gb": 0.05,
        "vllm_importance_sampling_correction": True,
        "vllm_importance_sampling_cap": 2.0,
    }
    pool = world(2, env={"HYBRIDZERO_TEST_POOL": "vllm"})  # its own pool: vLLM's state stays out of the others
    try:
        results = pool.run(vllm_grpo_run, settings, ITERATIONS, 1, timeout=540)
    finally:
        pool.close()
    for r in results:
        assert len(r["history"]) == ITERATIONS
        assert all(math.isfinite(v) for m in r["history"] for v in m.values())
        assert r["steps"] == ITERATIONS * 2  # 4 rows a rank in mini-batches of 2: two updates an iteration
        assert r["syncs_in_run"] == ITERATIONS  # before each rollout: the start's weights, then the updated ones
        assert r["same_names"] and r["bitwise"] and r["dtypes"] == ["torch.bfloat16"]
        # the tiny model's parameters are all below ZeRO-3's persistence threshold: one always-whole bucket a sync
        # and no gather (block-by-block gathers: tests/unit/test_rollout_engines.py, test_vllm_engine.py)
        assert r["sync_entries"] == ITERATIONS + 1 and r["sync_gathers"] == 0
        assert r["left"] == []
        assert r["env_kept"] and r["threads_settable"]  # vLLM's start changed neither (vllm_engine._ProcessState)
    timing = ("e2e_s", "generation_s", "training_s", "weight_sync_s")
    h0, h1 = ([{k: v for k, v in m.items() if k not in timing} for m in r["history"]] for r in results)
    assert h0 == h1  # every metric is a global one: the ranks agree
    errors = [r["error"] for r in results]
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert "vLLM engine died (injected)" in errors[0]

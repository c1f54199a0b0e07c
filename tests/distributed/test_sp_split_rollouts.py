"""Sequence parallelism with the rollout engines that split generation by sample over the SP group
(``rlhf/rollout/sp_split.py``): tensor-parallel generation (``--enable_hybrid_engine --inference_tp_size 2``) and
colocated vLLM engines (``--rollout_engine vllm``), each against the world-1 run on the same global batch.

The demo's tiny Llama (hidden 64, 4 query heads of 32 over 2 kv heads, intermediate 176: splittable by s = 2 and by
t = 2, and a head size vLLM's CPU attention takes), ZeRO-3, fp32, two GRPO iterations of 8 samples and mini-batches
of 4, compared with ``tests/distributed/test_grpo_sequence_parallel.py``'s ``_check`` and its tolerances (its
docstring derives them): the same rewards and counts, losses within 2e-5, parameters within 1e-6. What differs from
that file's runs is only who generates which rows:

* tensor-parallel (SP and TP groups are both blocks of consecutive ranks): each rank brings its share of the data
  rank's samples to its TP group's joint batch, whose decode computes each row's logits over the TP group
  (all-reduced partial products: rounding only; each row keeps its own Gumbel noise, ``OwnRowsProcessor``), and takes
  back its own rows before the SP all-gather. GRPO with the KL term; DAPO with its refills.
  Putting the shares back in the wrong order fails it (the gradient norm: 1.75 against 2.72).
* vLLM (slow: one engine per rank, started once per run): world 2 (s = 2) against world 1, each rank's own engine
  generating its share (per-request seeds: the same samples as one engine generating all, up to the batch's
  rounding), with the importance-sampling correction on (the sampler's log-probs are gathered with the rows; each
  share's in reverse order gives a loss of 0.039 against 3.7e-7). Measured: metrics within 8.9e-9, parameters within
  1.4e-7.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hybridzero.rlhf.data.demo_task import demo_data_dir
from tests.distributed.test_grpo_sequence_parallel import _check, _check_split, _gaps
from tests.workers.grpo_sp import grpo_params_run
from tests.workers.rlhf_runs import make_model_dirs

R = "tests.workers.rlvr_rewards:"
GLOBAL_GEN, GLOBAL_TRAIN = 8, 4
TP_RUNS: dict[str, dict[str, Any]] = {
    "grpo-tp": {"algorithm": "grpo", "reward_funcs": [R + "digit_share", R + "matches_target"], "beta": 0.05},
    "dapo-tp": {"algorithm": "dapo", "reward_funcs": [R + "first_is_digit"], "max_resample_rounds": 2},
}
VLLM_RUNS: dict[str, dict[str, Any]] = {
    "grpo-vllm": {
        "algorithm": "grpo",
        "reward_funcs": [R + "digit_share", R + "matches_target"],
        "rollout_engine": "vllm",
        "vllm_kv_cache_gb": 0.05,
        "vllm_importance_sampling_correction": True,
        "vllm_importance_sampling_cap": 2.0,
    },
}


@pytest.fixture(scope="module")
def demo_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return make_model_dirs(tmp_path_factory.mktemp("sp_split_models"))


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> str:
    rows = [json.loads(line) for line in (demo_data_dir() / "prompts.jsonl").read_text().splitlines()[:32]]
    for row in rows[::2]:
        row["target"] = " ".join(reversed(row["prompt"].rstrip("=").split()))
    path = tmp_path_factory.mktemp("sp_split_data") / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _runs(
    dirs: tuple[str, str], data: str, out: Path, world: int, sp: int, tp: int, runs: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """The named runs at ``world`` ranks, SP size ``sp``, tensor-parallel generation over ``tp`` ranks."""
    dp = world // sp
    base = {
        "actor_model_name_or_path": dirs[0],
        "critic_model_name_or_path": dirs[1],
        "data_path": [data],
        "data_split": "0,0,1",
        "per_device_generation_batch_size": GLOBAL_GEN // dp,
        "per_device_training_batch_size": GLOBAL_TRAIN // dp,
        "group_size": 2,
        "max_prompt_seq_len": 8,
        "max_answer_seq_len": 6,
        "actor_learning_rate": 3e-3,
        "max_steps": 2,
        "progress": False,
        "enable_tensorboard": False,
        "print_every": 1000,
        "resume": False,
        "seed": 5,
        "enable_hybrid_engine": True,
        "inference_tp_size": tp,
        "reward_model": False,
        "sequence_parallel_size": sp,
    }
    return {
        name: {**base, **knobs, "output_dir": str(out / f"{name}-w{world}-s{sp}-t{tp}")} for name, knobs in runs.items()
    }


@pytest.mark.slow
@pytest.mark.parametrize(("world_size", "sp", "tp"), [(2, 2, 2), (4, 2, 2), (4, 4, 2)])
def test_tensor_parallel_generation_under_sp_equals_s1(
    world, demo_dirs, prompts, tmp_path: Path, world_size: int, sp: int, tp: int
) -> None:
    """World 2 and 4, s = t = 2 (each TP group is an SP group; at world 4 two data ranks); world 4, s = 4, t = 2 (two
    TP groups inside one SP group, each joining two shares; 4 query heads over 2 kv heads: Ulysses repeats the kv
    heads at s = 4). DAPO refills a single dead group (2 samples) at least once: at s = 4 two ranks' shares are empty
    and generate placeholders, so one TP group's joint batch is two placeholder rows. Measured: metrics within
    2.4e-7, parameters within 4.1e-7."""
    base = world(1).run(grpo_params_run, _runs(demo_dirs, prompts, tmp_path, 1, 1, 1, TP_RUNS), timeout=400)[0]
    runs = _runs(demo_dirs, prompts, tmp_path, world_size, sp, tp, TP_RUNS)
    results = world(world_size).run(grpo_params_run, runs, timeout=500)
    assert sum(m["resampled_groups"] for m in base["dapo-tp"]["history"]) > 0  # refills (of 1 group: empty shares)
    for name in TP_RUNS:
        _check_split(results, base, name, world_size == 2)
        for rank, res in enumerate(results):
            assert res[name]["sp"] and not base[name]["sp"], (rank, name)
            assert res[name]["tp_calls"] > 0 and base[name]["tp_calls"] == 0, (rank, name)  # generated over t ranks
            _check(res[name], base[name], f"world {world_size} s {sp} tp {tp} rank {rank} {name}")
            print(f"world {world_size} s {sp} tp {tp} rank {rank} {name} gaps {_gaps(res[name], base[name])}")


@pytest.mark.slow
def test_vllm_rollouts_at_sp2_equal_s1(world, demo_dirs, prompts, tmp_path: Path) -> None:
    """World 2 with s = 2 on vLLM engines of one rank each, and on one engine of both ranks (vLLM tensor parallelism
    2: the SP split's shares are joined again in the TP group, generated once, taken back), against world 1."""
    pytest.importorskip("vllm")
    env = {"HYBRIDZERO_TEST_POOL": "vllm"}  # pools of their own: vLLM's state stays out of the others
    out: list[list[dict[str, Any]]] = []
    for size, tp in ((1, 1), (2, 1), (2, 2)):
        pool = world(size, env=env)
        try:
            runs = _runs(demo_dirs, prompts, tmp_path, size, size, tp, VLLM_RUNS)
            out.append(pool.run(grpo_params_run, runs, timeout=540))
        finally:
            pool.close()
    base = out[0][0]
    for tp, results in ((1, out[1]), (2, out[2])):
        for name in VLLM_RUNS:
            _check_split(results, base, name, True)
            for rank, res in enumerate(results):
                assert res[name]["sp"] and not base[name]["sp"], (rank, name)
                _check(res[name], base[name], f"world 2 vllm tp {tp} rank {rank} {name}")
                print(f"world 2 vllm tp {tp} rank {rank} {name} gaps {_gaps(res[name], base[name])}")

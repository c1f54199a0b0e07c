"""``grpo`` and ``ppo --sequence_parallel_size 2`` train as the ``s = 1`` run on the same global batch (gloo worlds).

World 1 (s = 1) against world 2 (s = 2, dp 1) and world 4 (s = 2, dp 2), each with the same global generation
batch (16 sequences) and training mini-batch (8), ZeRO-3, fp32, two iterations of a tiny Llama with eager attention
(hidden 44 = 4 x 11, intermediate 67, vocabulary 15: matrices such as 44 x 67 and 15 x 44 have numels not divisible
by 3 or 4, so shards are padded; the hidden size is a multiple of the 4 query heads, as transformers requires; the
4 query heads of 32 over 2 kv heads are split by s = 2). Three algorithms cover what the split must keep whole:
``grpo`` (the KL term: the reference forward is split too; the per-answer length normaliser; batch-scaled std; two
passes per batch, so the second sees ratios != 1), ``gspo`` (the sequence-level importance ratio, a mean over the
whole answer; stop strings; the non-hybrid generate path) and ``dapo`` (the token normaliser, clip-higher, dynamic
sampling: regenerated groups).

Checked: the same rewards, answer lengths and sample counts (the SP group's ranks generate the s = 1 samples between
them, each a contiguous share, and all-gather the rows over the group: ``rlhf/rollout/sp_split.py``; each sample's
tokens depend only on its seed and logits, so the smaller batches change only the logits' rounding), the same
losses, clip fractions, KLs and gradient norms, and the same parameters after training.

Tolerances. The split forwards differ from the s = 1 forwards only in summation order (the Ulysses exchanges move
values; the packed block-causal mask excludes the same keys as the padded causal mask; each slot's log-prob is one
rank's value plus exact zeros), as in ``tests/distributed/test_sp_packing.py``: ~1e-6 relative per log-prob. A
loss is a mean over <= 48 answer tokens of O(1) terms, its reassociation error <= 48 u max|term| ~ 3e-6:
``abs_tol = rel_tol = 2e-5`` (the first pass's loss is ~0, the group advantages summing to 0, so the bound must be
absolute too). Rewards and counts are functions of the sampled tokens (the same tokens): counts are exact, reward
means fp32 sums of <= 16 rewards, per data rank at dp 2 (<= 16 u ~ 1e-6 relative). The gradient norm (pre-clipping,
of each iteration's last step) sums squares of gradients carrying that rounding: 2e-5 relative. Parameters (full
fp32, after 4-6 AdamW steps of lr 3e-3, entries O(1)): a step moves an entry by ``lr m / sqrt(v)``, which the
gradients' 2e-5 relative rounding moves by about as much, so the drift is <= 6 x 2e-5 x lr ~ 4e-7 plus the entries'
own fp32 rounding (u |p| ~ 1.2e-7): ``rtol`` 2e-5, ``atol`` 1e-6. Measured: losses within 3e-8, parameters within
1.2e-7 (one ulp). An entry whose gradient is within rounding of 0 could flip Adam's sign and move by ~lr: not seen.
The same fixtures and tolerances serve GRPO with the reward model scoring (its scores split) and PPO (the critic's
values split, trained through the split forwards; its gradient norm and parameters checked like the actor's; the EMA
actor's parameters too), the token budget (chunked forwards: more, smaller sums) and ptx (an LM token mean over
<= 112 tokens per step).
What bites: a loss scaled for the world instead of the data-parallel ranks (which AdamW's update would hide) doubles
the gradient norm and moves the clipped second-pass losses; an SP rank counted twice in the normalisers halves the
losses.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridzero.rlhf.data.demo_task import demo_data_dir
from tests.workers.grpo_sp import grpo_params_run
from tests.workers.rlhf_runs import make_model_dirs

GLOBAL_GEN, GLOBAL_TRAIN = 16, 8
R = "tests.workers.rlvr_rewards:"
EXACT = ("reward", "answer_len", "skipped_samples", "resampled_groups", "truncated_fraction")
CLOSE = (
    "actor_loss",
    "clip_fraction",
    "approx_kl",
    "kl",
    "grad_norm",
    "critic_loss",
    "value",
    "critic_grad_norm",
    "ptx_loss",
)
TOL = 2e-5
SUM_TOL = 1e-6  # fp32 sums of <= 16 rewards split over dp ranks: <= 16 u ~ 1e-6 relative
LR = 3e-3
PARAM_ATOL = 1e-6
RUNS: dict[str, dict[str, Any]] = {
    "grpo": {
        "reward_funcs": [R + "digit_share", R + "matches_target"],
        "scale_rewards": "batch",
        "beta": 0.05,
        "num_iterations": 2,
    },
    "gspo": {
        "reward_funcs": [R + "digit_share", R + "nothing_after_equals"],
        "stop_strings": ["="],
        "enable_hybrid_engine": False,
    },
    "dapo": {"reward_funcs": [R + "first_is_digit"], "overlong_buffer_length": 2, "max_resample_rounds": 2},
}
# PPO (DeepSpeed-Chat's step 3): the critic's per-token values and the reward model's scores split too; with the
# EMA actor (beta 0.5: after two updates it is 0.75 of the way to the actor, far outside the tolerance of its start)
PPO_RUNS: dict[str, dict[str, Any]] = {
    "ppo": {"algorithm": "ppo", "critic_learning_rate": LR, "enable_ema": True, "ema_beta": 0.5},
}
# --max_tokens_per_batch: every rollout forward and each training mini-batch in packed chunks of <= 20 tokens (rows
# of <= 14 tokens: chunks of one or two sequences, so a mini-batch of 4-8 rows takes several chunks; at dp 2 the data
# ranks' chunk counts differ and the shorter pads with stand-ins); PPO with the reward model, GRPO without
BUDGET = {"packing_samples": True, "max_tokens_per_batch": 20}
BUDGET_RUNS: dict[str, dict[str, Any]] = {
    "ppo-budget": {"algorithm": "ppo", "critic_learning_rate": LR, **BUDGET},
    "grpo-budget": {"algorithm": "grpo", "reward_funcs": [R + "digit_share"], "beta": 0.05, **BUDGET},
}
# ptx (DeepSpeed-Chat's unsupervised step after each mini-batch, coefficient 0.5): its LM batches dealt to data ranks
# and each packed row split over the SP group; PPO with one whole-batch forward, GRPO in the token budget's chunks
PTX = {"unsupervised_dataset_name": "demo", "unsupervised_dataset_config_name": "demo", "unsup_coef": 0.5}
PTX_RUNS: dict[str, dict[str, Any]] = {
    "ppo-ptx": {"algorithm": "ppo", "critic_learning_rate": LR, **PTX},
    "grpo-ptx-budget": {"algorithm": "grpo", "reward_funcs": [R + "digit_share"], "beta": 0.05, **PTX, **BUDGET},
}
# the reward model scores too (with a reward function: both sources, weighted); its forwards are split as well
RM_RUNS: dict[str, dict[str, Any]] = {
    "grpo-rm": {"algorithm": "grpo", "reward_model": True, "reward_funcs": [R + "digit_share"], "beta": 0.05},
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return make_model_dirs(tmp_path_factory.mktemp("grpo_sp_models"), hidden_size=44, intermediate_size=67)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> str:
    rows = [json.loads(line) for line in (demo_data_dir() / "prompts.jsonl").read_text().splitlines()[:64]]
    for row in rows[::2]:
        row["target"] = " ".join(reversed(row["prompt"].rstrip("=").split()))
    path = tmp_path_factory.mktemp("grpo_sp_data") / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _runs(
    dirs: tuple[str, str], data: str, out: Path, world: int, sp: int, runs: dict[str, dict[str, Any]] = RUNS
) -> dict[str, dict[str, Any]]:
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
        "actor_learning_rate": LR,
        "max_steps": 2,
        "progress": False,
        "enable_tensorboard": False,
        "print_every": 1000,
        "resume": False,
        "seed": 5,
        "enable_hybrid_engine": True,
        "reward_model": False,
        "sequence_parallel_size": sp,
    }
    return {
        name: {**base, "algorithm": name, "output_dir": str(out / f"{name}-w{world}-s{sp}"), **knobs}
        for name, knobs in runs.items()
    }


def _check(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    assert len(got["history"]) == len(want["history"]) == 2, where
    for it, (g, w) in enumerate(zip(got["history"], want["history"])):
        for key in (k for k in w if k in EXACT or k.startswith("rewards/")):
            assert math.isclose(g[key], w[key], rel_tol=SUM_TOL, abs_tol=SUM_TOL), (where, it, key, g[key], w[key])
        for key in (k for k in CLOSE if k in w):
            assert math.isclose(g[key], w[key], rel_tol=TOL, abs_tol=TOL), (where, it, key, g[key], w[key])
    assert got["params"].keys() == want["params"].keys(), where
    for name, w in want["params"].items():
        torch.testing.assert_close(got["params"][name], w, rtol=TOL, atol=PARAM_ATOL, msg=f"{where} {name}")


def _gaps(got: dict[str, Any], want: dict[str, Any]) -> dict[str, float]:
    """The largest absolute differences of the ``CLOSE`` metrics and of the parameters (printed: ``pytest -s``)."""
    pairs = zip(got["history"], want["history"])
    close = max((abs(g[k] - w[k]) for g, w in pairs for k in CLOSE if k in w), default=0.0)
    params = max(float((got["params"][n] - w).abs().max()) for n, w in want["params"].items())
    return {"metrics": close, "params": params}


def _check_split(results: list[dict[str, Any]], base: dict[str, Any], name: str, halves: bool) -> None:
    """Generation was split over each SP group (rows gathered over the SP group, nowhere else). ``halves`` (s = 2,
    dp 1): the two ranks generated the s = 1 run's rows between them, each its half (every call's row count is even:
    groups of 2); else each rank generated under half of world 1's rows (s = 2 at dp 2, where a data rank without a
    dead group adds a placeholder refill; s = 4)."""
    assert base[name]["rows_gathered_sp"] == 0 and base[name]["rows_gathered_elsewhere"] == 0, name
    for rank, res in enumerate(results):
        got = res[name]
        assert got["rows_gathered_sp"] > 0 and got["rows_gathered_elsewhere"] == 0, (rank, name)
        if halves:
            assert 2 * got["generated"] == base[name]["generated"], (rank, name, got["generated"])
        else:
            assert 2 * got["generated"] < base[name]["generated"], (rank, name, got["generated"])


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_grpo_at_sp2_equals_s1(world, dirs, prompts, tmp_path: Path, world_size: int) -> None:
    """Generation split by sample over the SP group (``rlhf/rollout/sp_split.py``): hybrid engine (grpo, dapo with
    its refills) and ZeRO-3 ``module.generate`` (gspo)."""
    base = world(1).run(grpo_params_run, _runs(dirs, prompts, tmp_path, 1, 1), timeout=400)[0]
    assert sum(m["resampled_groups"] for m in base["dapo"]["history"]) > 0  # dynamic sampling was exercised
    assert base["grpo"]["history"][1]["clip_fraction"] >= 0.0
    results = world(world_size).run(grpo_params_run, _runs(dirs, prompts, tmp_path, world_size, 2), timeout=500)
    for name in RUNS:
        _check_split(results, base, name, world_size == 2)
    for rank, res in enumerate(results):
        for name in RUNS:
            assert res[name]["sp"] and not base[name]["sp"], (rank, name)  # the actor's forwards were split
            _check(res[name], base[name], f"world {world_size} rank {rank} {name}")
            print(f"world {world_size} rank {rank} {name} gaps {_gaps(res[name], base[name])}")


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_grpo_reward_model_at_sp2_equals_s1(world, dirs, prompts, tmp_path: Path, world_size: int) -> None:
    """The reward model's end-of-sequence scores from split forwards (``rlhf/rollout/sp_values.py``): the same
    rewards (per source) as the s = 1 run, hence the same advantages, losses and parameters."""
    base = world(1).run(grpo_params_run, _runs(dirs, prompts, tmp_path, 1, 1, RM_RUNS), timeout=400)[0]
    assert any(k.startswith("rewards/") for k in base["grpo-rm"]["history"][0])  # per-source means are logged
    results = world(world_size).run(
        grpo_params_run, _runs(dirs, prompts, tmp_path, world_size, 2, RM_RUNS), timeout=500
    )
    for rank, res in enumerate(results):
        assert res["grpo-rm"]["rm_sp"] and not base["grpo-rm"]["rm_sp"], rank  # the reward model's forwards split
        _check(res["grpo-rm"], base["grpo-rm"], f"world {world_size} rank {rank} grpo-rm")


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_ppo_at_sp2_equals_s1(world, dirs, prompts, tmp_path: Path, world_size: int) -> None:
    """PPO: the actor's log-probs, the critic's per-token values (GAE's input, and the clipped value loss's, which
    trains the critic through the split forwards) and the reward model's scores: the same rewards, values, losses,
    gradient norms and actor and critic parameters as the s = 1 run. The EMA actor (split too, its shards over the
    whole world as the actor's) moves from the same actor shards: the same EMA parameters, to the actor's
    tolerance (a convex mix of the initial and the actor's parameters carries at most their rounding)."""
    base = world(1).run(grpo_params_run, _runs(dirs, prompts, tmp_path, 1, 1, PPO_RUNS), timeout=400)[0]
    assert {"critic_loss", "value", "critic_grad_norm"} <= base["ppo"]["history"][0].keys()
    results = world(world_size).run(
        grpo_params_run, _runs(dirs, prompts, tmp_path, world_size, 2, PPO_RUNS), timeout=500
    )
    _check_split(results, base, "ppo", world_size == 2)
    for rank, res in enumerate(results):
        got = res["ppo"]
        assert got["sp"] and got["rm_sp"] and got["critic_sp"] and got["ema_sp"] and not base["ppo"]["ema_sp"], rank
        assert {n.split("/")[0] for n in got["params"] if "/" in n} >= {"critic", "ema"}, rank
        _check(got, base["ppo"], f"world {world_size} rank {rank} ppo")
        print(f"world {world_size} rank {rank} ppo gaps {_gaps(got, base['ppo'])}")


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_token_budget_at_sp2_equals_s1(world, dirs, prompts, tmp_path: Path, world_size: int) -> None:
    """``--max_tokens_per_batch`` under SP: each chunk of the token budget is one packed row split over the SP group
    (both ranks plan the same chunks from the same rows); each chunk's loss weighted by its share of the mini-batch's
    tokens, so the chunks sum to the mini-batch's loss. The same numbers as the budgeted s = 1 run (whose chunks are
    the same at world 2, and at world 4 differ only in which rows share a chunk: summation order)."""
    base = world(1).run(grpo_params_run, _runs(dirs, prompts, tmp_path, 1, 1, BUDGET_RUNS), timeout=400)[0]
    results = world(world_size).run(
        grpo_params_run, _runs(dirs, prompts, tmp_path, world_size, 2, BUDGET_RUNS), timeout=500
    )
    for rank, res in enumerate(results):
        for name in BUDGET_RUNS:
            assert res[name]["sp"] and not base[name]["sp"], (rank, name)
            _check(res[name], base[name], f"world {world_size} rank {rank} {name}")


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_ptx_at_sp2_equals_s1(world, dirs, prompts, tmp_path: Path, world_size: int) -> None:
    """ptx under SP: the SP group shares its data rank's slice of each global LM batch (``per_device_training_batch
    _size x D`` records, the s = 1 run's batch), packed and split by sequence; the LM loss is scaled for the data
    ranks as the RL losses are. The same ptx losses (token means over <= 8 x 14 tokens: reassociation <= 112 u ~
    7e-6 relative, inside ``TOL``), gradient norms (of the ptx step, each iteration's last) and parameters as the
    s = 1 run. Dealing ptx by world rank instead gives the SP ranks different batches: the split forward fails."""
    base = world(1).run(grpo_params_run, _runs(dirs, prompts, tmp_path, 1, 1, PTX_RUNS), timeout=400)[0]
    results = world(world_size).run(
        grpo_params_run, _runs(dirs, prompts, tmp_path, world_size, 2, PTX_RUNS), timeout=500
    )
    for rank, res in enumerate(results):
        for name in PTX_RUNS:
            assert res[name]["sp"] and "ptx_loss" in base[name]["history"][0], (rank, name)
            _check(res[name], base[name], f"world {world_size} rank {rank} {name}")

"""``reward --sequence_parallel_size 2`` trains the reward model as the ``s = 1`` run on the same global batch.

World 1 (s = 1) against world 2 (s = 2, dp 1) and world 4 (s = 2 x dp 2) on real gloo worlds, each with the same
global batch of 8 pairs per step (per data rank 8, 8, 4), ZeRO-3, fp32, three AdamW steps of the demo's tiny Llama
trunk with a value head (eager attention, hidden 44 = 4 x 11, intermediate 67, vocabulary 15: numels such as 44 x 67
and 15 x 44 are not divisible by 3 or 4, so shards are padded; the 4 query heads over 2 kv heads are split by
s = 2). Two runs: padded micro-batches (the s = 1 run forwards padded rows, the s = 2 run packed slices: the split
path is checked against the plain one), and ``--max_tokens_per_batch`` with 2 accumulation steps (packed chunks of
whole pairs, at both s; chunk weights and stand-ins under SP). Checked: every step's loss, accuracy and mean chosen /
rejected scores, the held-out metrics, and the saved value model's parameters (trunk and head).

Tolerances. The split forwards differ from the s = 1 forwards only in summation order (the all-to-alls move values,
the block-causal mask excludes the same keys as the padded causal mask, each score is one rank's value plus exact
zeros), as in ``tests/distributed/test_sequence_parallel.py``: ~1e-6 relative per score. The loss is a mean over 8
pairs of ``-log sigmoid`` of O(1) score differences: reordering error ~ 8 u max|term| ~ 1e-6, so ``rel_tol = abs_tol
= 2e-5`` (scores can be near 0, so absolute too). Accuracy counts pairs with chosen > rejected: exact unless a score
difference is within rounding of 0 (not seen; checked exactly). Parameters (full fp32 after 3 steps of lr 3e-3,
entries O(0.1)): Adam normalises each entry, so an entry's move ``lr m / sqrt(v)`` carries its own gradient's
relative rounding, ~ n u max|g| / |g_i| for a sum of n ~ 50 reordered contributions; for entries down to 1e-2 of
their tensor's largest gradient that is ~3e-4 relative, ~1e-6 per step, so ``atol`` 1e-5 over 3 steps (``rtol``
2e-5). Measured (world 2 and 4): parameters within 9.1e-7 (a k_proj entry), losses within 9e-8, gradient norms
within 1.2e-6 (4e-7 relative), accuracies equal. An entry whose gradient is within rounding of 0 could flip Adam's
sign and move by ~lr: not seen. The held-out metrics are taken after training, from parameters that differ by that
drift: a score sums ~1e4 products of weights and activations, so ~1e-6 random-signed weight differences move it by
~1e-5 (measured: 1.1e-5 on scores O(0.05), 1e-7 on the loss): ``EVAL_TOL`` 1e-4, absolute and relative. The gradient
norm (pre-clipping, every step; ``gradient_clipping`` 1.0 computes it) carries the gradients' rounding: 2e-5
relative. What bites (AdamW's update is blind to a uniform gradient scale, the norm is not): the loss scaled by
``s`` doubles every step's ``grad_norm``; the scores read from one rank's slice only (no sum over the group) change
the losses at once.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.workers.rlhf_runs import make_model_dirs, reward_run

GLOBAL = 8
STEP_KEYS = ("loss", "chosen_score", "rejected_score", "grad_norm")
EVAL_KEYS = ("eval_loss", "eval_chosen_score", "eval_rejected_score")
TOL = 2e-5
EVAL_TOL = 1e-4  # held-out scores are taken after training: they inherit the parameters' drift (module docstring)
PARAM_ATOL = 1e-5
RUNS: dict[str, dict[str, Any]] = {
    "padded": {"gradient_accumulation_steps": 1},
    "budget": {"gradient_accumulation_steps": 2, "max_tokens_per_batch": 56, "packing_samples": True},
}


@pytest.fixture(scope="module")
def actor_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_model_dirs(tmp_path_factory.mktemp("reward_sp_models"), hidden_size=44, intermediate_size=67)[0]


def _settings(actor: str, out: Path, name: str, world: int, sp: int) -> dict[str, Any]:
    knobs = RUNS[name]
    micro = GLOBAL // (world // sp) // knobs["gradient_accumulation_steps"]
    return {
        "model_name_or_path": actor,
        "output_dir": str(out / f"{name}-w{world}-s{sp}"),
        "per_device_train_batch_size": micro,
        "per_device_eval_batch_size": 8,
        "max_seq_len": 24,
        "max_steps": 3,
        "learning_rate": 3e-3,
        "eval_fraction": 0.02,
        "num_warmup_steps": 0,
        "progress": False,
        "print_every": 1000,
        "enable_tensorboard": False,
        "seed": 3,
        "sequence_parallel_size": sp,
        **knobs,
    }


def _record(out_dir: str) -> dict[str, Any]:
    """The run's per-step metrics (rank 0's ``metrics.jsonl``) and its saved value model."""
    from safetensors.torch import load_file

    from hybridzero.rlhf.models import VALUE_MODEL_FILE
    from hybridzero.rlhf.runlog.metrics import read_metrics

    rows = read_metrics(out_dir)
    return {
        "steps": [r for r in rows if r["phase"] == "reward"],
        "eval": [r for r in rows if r["phase"] == "reward_eval"],
        "params": load_file(str(Path(out_dir) / VALUE_MODEL_FILE)),
    }


def _close(got: float, want: float, tol: float) -> bool:
    return math.isclose(got, want, rel_tol=tol, abs_tol=tol)


def _check(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    assert len(got["steps"]) == len(want["steps"]) == 3, where
    for g, w in zip(got["steps"], want["steps"]):
        for key in STEP_KEYS:
            assert _close(g[key], w[key], TOL), (where, w["step"], key, g[key], w[key])
        assert g["accuracy"] == w["accuracy"], (where, w["step"])
    assert len(got["eval"]) == len(want["eval"]) > 0, where  # the held-out pass ran (split too)
    for g, w in zip(got["eval"], want["eval"]):
        for key in EVAL_KEYS:
            assert _close(g[key], w[key], EVAL_TOL), (where, w["step"], key, g[key], w[key])
        assert g["eval_accuracy"] == w["eval_accuracy"], (where, w["step"])
    assert got["params"].keys() == want["params"].keys(), where
    for name, w in want["params"].items():
        torch.testing.assert_close(got["params"][name], w, rtol=TOL, atol=PARAM_ATOL, msg=f"{where} {name}")


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_reward_model_at_sp2_equals_s1(world, actor_dir: str, tmp_path: Path, world_size: int) -> None:
    for name in RUNS:
        world(1).run(reward_run, _settings(actor_dir, tmp_path, name, 1, 1), timeout=300)
        finals = world(world_size).run(reward_run, _settings(actor_dir, tmp_path, name, world_size, 2), timeout=400)
        want = _record(str(tmp_path / f"{name}-w1-s1"))
        _check(_record(str(tmp_path / f"{name}-w{world_size}-s2")), want, f"world {world_size} {name}")
        for rank, final in enumerate(finals):  # every rank reports the same global numbers
            assert _close(final["eval_loss"], want["eval"][-1]["eval_loss"], EVAL_TOL), (name, rank)

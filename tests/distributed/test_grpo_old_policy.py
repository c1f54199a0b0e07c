"""GRPO without the old log-prob pass (``old_logprobs="auto"``, :mod:`hybridzero.rlhf.steps.rl.old_policy`) trains
as the run with the pass does, at world 1 and 2: an iteration that is one optimizer step (one mini-batch, or
mini-batches accumulated into one step) takes its old log-probs from the update forward; two steps an iteration
keep the pass.

Tolerances: the first iteration's samples come from the same initial weights through the same generation, so its
rewards are equal exactly. Its loss differs only through the ratio ``w = exp(logp - old)``: 1 exactly without the
pass, and ``1 + (logp - old)`` with it, where ``logp`` and ``old`` are two fp32 forwards over the same tokens
(``|logp - old|`` a few ulp of a log-prob of magnitude <= ~10, so <= ~1e-5), times advantages of magnitude
<= ``sqrt(group_size)``: ``1e-4`` absolute. Later iterations compare as the world-size tests do (relative 2e-4).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.test_rlhf_grpo import _close, _settings, dirs, prompts  # noqa: F401 - fixtures
from tests.workers.rlvr_runs import grpo_family_run

R = "tests.workers.rlvr_rewards:"
GEN = 16  # sequences per generation batch, all ranks together
COMPARED = ("reward", "actor_loss", "kl", "answer_len", "truncated_fraction")
MASKED = {"reward_funcs": [R + "nan_everywhere"], "reward_error_policy": "skip"}  # every sample skipped


def _runs(d: tuple[str, str], data: str, out: Path, world: int) -> dict[str, dict[str, Any]]:
    base = {
        "reward_funcs": [R + "digit_share", R + "matches_target"],
        "reward_model": False,
        "beta": 0.05,  # a reference pass and the rollout KL metric, which reads the old log-probs
        "lr_scheduler_type": "constant",  # the first step moves the actor (warmup_cosine starts at lr 0)
    }

    def one(name: str, train: int, accum: int, mode: str) -> dict[str, Any]:
        knobs = {**base, "beta": 0.0} if accum > 1 else base  # no KL: nothing writes the old log-probs back
        s = _settings(d, data, out / name, world, **knobs, old_logprobs=mode, gradient_accumulation_steps=accum)
        return {**s, "per_device_generation_batch_size": GEN // world, "per_device_training_batch_size": train // world}

    return {
        "auto": one("auto", GEN, 1, "auto"),
        "pass": one("pass", GEN, 1, "rollout_pass"),
        "auto_accum": one("auto_accum", GEN // 2, 2, "auto"),
        "pass_accum": one("pass_accum", GEN // 2, 2, "rollout_pass"),
        "two_steps": one("two_steps", GEN // 2, 1, "auto"),
        # every sample skipped: no training token, no update forward to take old log-probs from
        "auto_masked": {**one("auto_masked", GEN, 1, "auto"), **MASKED},
        "pass_masked": {**one("pass_masked", GEN, 1, "rollout_pass"), **MASKED},
    }


def _assert_same_training(got: list[dict[str, float]], want: list[dict[str, float]], where: str) -> None:
    assert len(got) == len(want) == 2, where
    first, first_want = got[0], want[0]
    assert first["reward"] == first_want["reward"], where
    assert math.isclose(first["actor_loss"], first_want["actor_loss"], abs_tol=1e-4), (where, first, first_want)
    assert math.isclose(first["kl"], first_want["kl"], rel_tol=1e-4, abs_tol=1e-6), (where, first, first_want)
    for key in COMPARED:
        assert _close(got[1][key], want[1][key]), (where, key, got[1][key], want[1][key])


@pytest.mark.slow
def test_an_on_policy_iteration_needs_no_old_log_prob_pass(world, dirs, prompts, tmp_path: Path) -> None:  # noqa: F811
    histories = {
        w: world(w).run(grpo_family_run, _runs(dirs, prompts, tmp_path / f"w{w}", w), timeout=400)[0] for w in (1, 2)
    }
    for w, h in histories.items():
        assert [m["old_logprob_pass"] for m in h["auto"]] == [0.0, 0.0], w
        assert [m["old_logprob_pass"] for m in h["auto_accum"]] == [0.0, 0.0], w
        assert [m["old_logprob_pass"] for m in h["pass"]] == [1.0, 1.0], w
        assert [m["old_logprob_pass"] for m in h["two_steps"]] == [1.0, 1.0], w  # the 2nd mini-batch is off-policy
        assert all(m["approx_kl"] == 0.0 and m["clip_fraction"] == 0.0 for m in h["auto"] + h["auto_accum"]), w
        assert all(abs(m["approx_kl"]) < 1e-6 for m in h["pass"]), w  # the pass's ratio is 1 up to rounding
        assert h["auto"][1]["kl"] > 0, w  # the rollout KL reads the update forward's log-probs (0 before a step)
        _assert_same_training(h["auto"], h["pass"], f"world {w}, one mini-batch")
        _assert_same_training(h["auto_accum"], h["pass_accum"], f"world {w}, two accumulated mini-batches")
        for got, want in zip(h["auto_masked"], h["pass_masked"]):  # no update: the KL metric's old log-probs scored
            assert got["skipped_steps"] == 1.0 and got["old_logprob_pass"] == 0.0, (w, got)
            assert math.isclose(got["kl"], want["kl"], rel_tol=1e-4, abs_tol=1e-6), (w, got["kl"], want["kl"])
    for name in ("auto", "auto_accum"):
        for it, (got, want) in enumerate(zip(histories[2][name], histories[1][name])):
            for key in COMPARED:
                assert _close(got[key], want[key]), (name, it, key, got[key], want[key])

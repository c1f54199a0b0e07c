"""The GRPO family with reward functions on real gloo worlds: every ``--algorithm`` gives the same metrics at world 1,
2 and 4 (reward functions on each rank's own samples, dataset columns passed through, stop strings, dynamic
sampling, overlong shaping, several updates per batch); a reward function that raises, hangs or returns NaN on one
rank only makes every rank raise the same error, or is skipped on every rank, never a hang or a NaN update."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from hybridzero.rlhf.data.demo_task import demo_data_dir
from tests.workers.rlhf_runs import make_model_dirs
from tests.workers.rlvr_runs import failing_reward_run, grpo_family_run

GLOBAL_GEN, GLOBAL_TRAIN = 16, 8  # sequences per generation batch / training mini-batch, all ranks together
R = "tests.workers.rlvr_rewards:"
COMPARED = (
    "reward",
    "actor_loss",
    "clip_fraction",
    "approx_kl",
    "kl",
    "answer_len",
    "skipped_samples",
    "resampled_groups",
    "truncated_fraction",
)
ALGORITHMS: dict[str, dict[str, Any]] = {
    "grpo": {  # functions + the reward model, batch-scaled std, KL to the reference, 2 updates per batch
        "reward_funcs": [R + "digit_share", R + "matches_target"],
        "reward_weights": [1.0, 1.0, 0.5],
        "reward_model": True,
        "scale_rewards": "batch",
        "beta": 0.05,
        "num_iterations": 2,
    },
    "dr_grpo": {"reward_funcs": [R + "digit_share", R + "length_bonus"], "reward_weights": [1.0, -0.5]},
    "dapo": {
        "reward_funcs": [R + "first_is_digit"],
        "overlong_buffer_length": 2,
        "mask_truncated_completions": True,
        "max_resample_rounds": 2,
    },
    "gspo": {"reward_funcs": [R + "digit_share", R + "nothing_after_equals"], "stop_strings": ["="]},
    "rloo": {"reward_funcs": [R + "digit_share", R + "matches_target"]},
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return make_model_dirs(tmp_path_factory.mktemp("grpo_models"))


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The demo's prompts with a ``target`` column (the reversal) for every other row: extra columns reach the
    reward functions, rows without one give None."""
    rows = [json.loads(line) for line in (demo_data_dir() / "prompts.jsonl").read_text().splitlines()[:64]]
    path = tmp_path_factory.mktemp("grpo_data") / "prompts.jsonl"
    lines = []
    for i, row in enumerate(rows):
        digits = row["prompt"].rstrip("=").split()
        extra = {"target": " ".join(reversed(digits)), "level": i % 3} if i % 2 == 0 else {"level": i % 3}
        lines.append(json.dumps({**row, **extra}))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _settings(dirs: tuple[str, str], data: str, out: Path, world: int, **changes: Any) -> dict[str, Any]:
    actor, value = dirs
    return {
        "actor_model_name_or_path": actor,
        "critic_model_name_or_path": value,
        "data_path": [data],
        "data_split": "0,0,1",
        "output_dir": str(out),
        "per_device_generation_batch_size": GLOBAL_GEN // world,
        "per_device_training_batch_size": GLOBAL_TRAIN // world,
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
        **changes,
    }


def _close(got: float, want: float) -> bool:
    return math.isclose(got, want, rel_tol=2e-4, abs_tol=2e-5)


@pytest.mark.slow
def test_every_algorithm_gives_the_same_metrics_at_world_1_2_4(world, dirs, prompts, tmp_path: Path) -> None:
    histories = {}
    for w in (1, 2, 4):
        runs = {
            name: _settings(
                dirs, prompts, tmp_path / f"{name}-w{w}", w, algorithm=name, **{"reward_model": False, **knobs}
            )
            for name, knobs in ALGORITHMS.items()
        }
        histories[w] = world(w).run(grpo_family_run, runs, timeout=400)[0]
    for name in ALGORITHMS:
        base = histories[1][name]
        assert len(base) == 2 and all(math.isfinite(v) for m in base for v in m.values()), name
        keys = [*COMPARED, *(k for k in base[0] if k.startswith("rewards/"))]
        for w in (2, 4):
            for it, (got, want) in enumerate(zip(histories[w][name], base)):
                for key in keys:
                    assert _close(got[key], want[key]), (name, w, it, key, got[key], want[key])
    one = histories[1]
    assert set(one["grpo"][0]) >= {"rewards/digit_share", "rewards/matches_target", "rewards/reward_model"}
    assert all(m["rewards/nothing_after_equals"] == 1.0 for m in one["gspo"])  # answers cut after the stop string
    assert sum(m["resampled_groups"] for m in one["dapo"]) > 0  # coarse rewards tie: groups were regenerated
    assert all(m["pad_fraction"] <= m["pad_fraction_untrimmed"] for h in one.values() for m in h)
    assert all(m["skipped_samples"] == 0 for h in one.values() for m in h)


@pytest.mark.parametrize(
    ("func", "timeout", "message"),
    [
        ("raise_on_rank", 30.0, "raised RuntimeError: checker crashed -- a batch of"),
        ("hang_on_rank", 2.0, "did not return within --reward_timeout 2 s"),
        ("nan_on_rank", 30.0, "returned nan for 1 sample(s) -- sample 1 of"),
    ],
)
def test_a_failing_reward_on_one_rank_raises_the_same_error_everywhere(
    world, dirs, prompts, tmp_path: Path, func: str, timeout: float, message: str
) -> None:
    knobs = {"reward_funcs": [R + func], "reward_timeout": timeout, "reward_model": False}
    results = world(2).run(failing_reward_run, _settings(dirs, prompts, tmp_path / func, 2, **knobs), 1, timeout=300)
    errors = [r["error"] for r in results]
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert errors[0].startswith("rank 1: reward function 'raise_on_rank'".replace("raise_on_rank", func))
    assert message in errors[0] and "reward_error_policy=raise" in errors[0]
    assert [r["left"] for r in results] == [[], []]  # the reward workers were closed and reaped on the error path


def test_skip_policy_skips_the_failing_samples_on_every_rank(world, dirs, prompts, tmp_path: Path) -> None:
    knobs = {
        "reward_funcs": [R + "nan_on_rank", R + "digit_share"],
        "reward_model": False,
        "reward_error_policy": "skip",
        "num_iterations": 2,
    }
    results = world(2).run(failing_reward_run, _settings(dirs, prompts, tmp_path / "skip", 2, **knobs), 1, timeout=300)
    assert all(r["error"] is None for r in results) and results[0]["finite"] is True
    assert [r["left"] for r in results] == [[], []]  # and at the end of a completed run
    h0, h1 = results[0]["history"], results[1]["history"]
    timing = ("e2e_s", "generation_s", "training_s", "weight_sync_s")
    assert [{k: v for k, v in m.items() if k not in timing} for m in h0] == [
        {k: v for k, v in m.items() if k not in timing} for m in h1
    ]  # every metric is a global one: the ranks agree
    assert all(m["skipped_samples"] == 1 for m in h0)  # the NaN sample of rank 1, once per iteration
    assert all(math.isfinite(v) for m in h0 for v in m.values())

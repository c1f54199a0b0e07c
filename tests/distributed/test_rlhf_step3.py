"""Step 3 (PPO / GRPO) on real gloo worlds: the DeepSpeed-Chat knob matrix at world 1, 2 and 4 gives the same
metrics (sampling is seeded per sample, losses are global token means), a crashed run resumes on the same curve,
a run killed with SIGKILL between two roles' checkpoint saves resumes from the last complete iteration, an fp16
overflow in either model skips both updates, and GRPO / ptx / EMA runs complete."""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridzero.rlhf.runlog.metrics import read_metrics
from tests.workers.rlhf_runs import ema_run, make_model_dirs, step3_run, step_both_run

REPO = Path(__file__).resolve().parents[2]

GLOBAL_GEN, GLOBAL_TRAIN = 8, 4  # sequences per generation batch / per training mini-batch, all ranks together
COMPARED = ("reward", "kl", "answer_len", "value", "actor_loss", "critic_loss", "clip_fraction")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return make_model_dirs(tmp_path_factory.mktemp("rlhf_models"))


def _settings(dirs: tuple[str, str], out: Path, world: int, **changes: Any) -> dict[str, Any]:
    actor, value = dirs
    base = {
        "actor_model_name_or_path": actor,
        "critic_model_name_or_path": value,
        "output_dir": str(out),
        "per_device_generation_batch_size": GLOBAL_GEN // world,
        "per_device_training_batch_size": GLOBAL_TRAIN // world,
        "max_prompt_seq_len": 8,
        "max_answer_seq_len": 6,
        "actor_learning_rate": 3e-3,
        "critic_learning_rate": 3e-3,
        "num_warmup_steps": 0,
        "max_steps": 2,
        "progress": False,
        "enable_tensorboard": False,
        "print_every": 1000,
        "resume": False,
        "seed": 5,
    }
    base.update(changes)
    return base


def _assert_same_metrics(runs: dict[int, list[dict[str, float]]], what: str) -> None:
    base = runs[1]
    for world, history in runs.items():
        assert len(history) == len(base), (what, world)
        for it, (got, want) in enumerate(zip(history, base)):
            for key in COMPARED:
                if key in want:
                    assert math.isclose(got[key], want[key], rel_tol=2e-4, abs_tol=2e-5), (
                        what,
                        world,
                        it,
                        key,
                        got[key],
                        want[key],
                    )


MATRIX = list(itertools.product((1, 3), (1, 2), (False, True), (2, 3)))


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_step3_matrix_matches_world_1(world, dirs, tmp_path: Path, world_size: int) -> None:
    """generation_batches x ppo_epochs x hybrid engine x critic stage, actor ZeRO-3: every run completes and the
    metrics of world ``world_size`` equal world 1's."""
    one, pool = world(1), world(world_size)
    for gen_batches, ppo_epochs, hybrid, critic_stage in MATRIX:
        what = f"gb{gen_batches}-pe{ppo_epochs}-hy{int(hybrid)}-c{critic_stage}"
        knobs = {
            "generation_batches": gen_batches,
            "ppo_epochs": ppo_epochs,
            "enable_hybrid_engine": hybrid,
            "critic_zero_stage": critic_stage,
            "actor_zero_stage": 3,
        }
        runs = {
            w: p.run(step3_run, _settings(dirs, tmp_path / f"{what}-w{w}", w, **knobs), timeout=240)[0]
            for w, p in ((1, one), (world_size, pool))
        }
        assert all(len(r["history"]) == 2 for r in runs.values()), what
        _assert_same_metrics({w: r["history"] for w, r in runs.items()}, what)


def test_hybrid_on_off_same_samples(world, dirs, tmp_path: Path) -> None:
    """The hybrid engine and plain ZeRO-3 generation sample the same answers (fp32, world 2)."""
    pool = world(2)
    runs = [
        pool.run(step3_run, _settings(dirs, tmp_path / f"h{h}", 2, enable_hybrid_engine=h))[0]["history"]
        for h in (False, True)
    ]
    _assert_same_metrics({1: runs[0], 2: runs[1]}, "hybrid on/off")


def test_resume_continues_the_same_curve(world, dirs, tmp_path: Path) -> None:
    """A run that crashes in iteration 3 resumes from its iteration-2 checkpoint and continues the uninterrupted
    run's curve (bitwise: checkpoints restore fp32 masters, Adam and schedules; samples depend on ids only)."""
    pool = world(2)
    knobs = {
        "max_steps": 4,
        "save_interval": 2,
        "unsupervised_dataset_name": "demo",
        "unsupervised_dataset_config_name": "demo",
        "unsup_coef": 0.5,
        "enable_ema": True,
    }
    full = pool.run(step3_run, _settings(dirs, tmp_path / "full", 2, **knobs))[0]
    crashed = tmp_path / "crashed"
    with pytest.raises(Exception, match="injected crash"):
        pool.run(step3_run, _settings(dirs, crashed, 2, **knobs), False, 3)
    resumed = pool.run(step3_run, _settings(dirs, crashed, 2, **{**knobs, "resume": True}))[0]
    assert resumed["start"] == 2 and len(resumed["history"]) == 2
    for got, want in zip(resumed["history"], full["history"][2:]):
        for key in (*COMPARED, "ptx_loss"):
            assert got[key] == want[key], key
    assert Path(resumed["models"]["actor_ema"], "model.safetensors").is_file()


def _kill_run(
    settings: dict[str, Any], kill_role: str, iteration: int, tmp_path: Path
) -> subprocess.CompletedProcess[str]:
    """A world-1 PPO run in a real subprocess that SIGKILLs itself before ``kill_role`` saves ``iteration``."""
    path = tmp_path / f"settings_{kill_role}_{iteration}.json"
    path.write_text(json.dumps(settings))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HYBRIDZERO_TIMEOUT_S": "120",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-m", "tests.workers.rlhf_kill", str(path), kill_role, str(iteration)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )


@pytest.mark.timeout(900)
def test_kill_between_actor_and_critic_save_resumes_from_last_complete_iteration(dirs, tmp_path: Path) -> None:
    """kill -9 after the actor saved iteration 4 and before the critic did: the actor's newest checkpoint is ahead
    of the critic's (the old "roles' latest checkpoints disagree"), no completion marker for 4; resume loads every
    role at iteration 2 and runs iterations 3 and 4 again, bitwise as the killed run had logged them."""
    out = tmp_path / "run"
    settings = _settings(dirs, out, 1, max_steps=4, save_interval=2, enable_ema=True)
    killed = _kill_run(settings, "critic", 4, tmp_path)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    ckpt = out / "checkpoints"
    assert (ckpt / "actor" / "iter4").is_dir() and not (ckpt / "critic" / "iter4").exists()
    assert sorted(p.name for p in (ckpt / "complete").iterdir()) == ["iter2.json"]
    logged = {r["step"]: r for r in read_metrics(out) if r["phase"] == "ppo"}
    assert sorted(logged) == [1, 2, 3, 4]  # every iteration ran and was logged before the kill
    resumed = _kill_run({**settings, "resume": True}, "none", 0, tmp_path)  # a role that never saves: no kill
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at iteration 2 (actor, critic, ema)" in resumed.stdout + resumed.stderr
    again = {r["step"]: r for r in read_metrics(out) if r["phase"] == "ppo"}
    for step in (3, 4):
        for key in (*COMPARED, "approx_kl"):
            assert again[step][key] == logged[step][key], (step, key)
    assert sorted(p.name for p in (ckpt / "complete").iterdir()) == ["iter2.json", "iter4.json"]
    assert Path(out, "critic", "value_model.safetensors").is_file()


def test_ema_update_from_is_the_elementwise_average_and_refuses_another_layout(world, dirs) -> None:
    """``ema = beta * ema + (1 - beta) * actor`` on the fp32 masters at world 2 equals the same elementwise ops on the
    full tensors (to an ulp: a shard's vectorized body and scalar tail may contract ``a + alpha * b`` into an FMA
    differently); a source with another layout (stage 0) is refused by name and nothing changes."""
    beta = 0.9
    for res in world(2).run(ema_run, dirs[0], beta):
        assert any(not torch.equal(res["before"][k], res["source"][k]) for k in res["before"])  # the actor moved
        for name, old in res["before"].items():
            want = old.clone().mul_(beta).add_(res["source"][name], alpha=1.0 - beta)
            torch.testing.assert_close(res["after"][name], want, rtol=1e-6, atol=1e-8, msg=name)
        assert res["error"] is not None and res["error"].startswith("ema_update_from: ")
        assert res["unchanged_after_error"]


@pytest.mark.parametrize("overflow_in", ["actor", "critic"])
def test_fp16_overflow_in_either_model_skips_both(world, dirs, overflow_in: str) -> None:
    res = world(2).run(step_both_run, *dirs, overflow_in)
    for r in res:
        assert r["skipped"] is True
        assert r["changed"] == {"actor": False, "critic": False}
        assert r["applied"] == {"actor": False, "critic": False}
        other = "critic" if overflow_in == "actor" else "actor"
        assert r["scales_after"][other] == r["scales_before"][other]  # the skipped one keeps its scale


def test_fp16_no_overflow_steps_both(world, dirs) -> None:
    """Control: the same setup without an injected inf updates both models."""
    for r in world(2).run(step_both_run, *dirs, "none"):
        assert r["skipped"] is False and r["changed"] == {"actor": True, "critic": True}


def test_grpo_matches_across_worlds(world, dirs, tmp_path: Path) -> None:
    knobs = {"group_size": 2, "grpo_kl_coef": 0.05}
    runs = {
        w: world(w).run(step3_run, _settings(dirs, tmp_path / f"g{w}", w, **knobs), True)[0]["history"] for w in (1, 2)
    }
    _assert_same_metrics(runs, "grpo")
    assert "critic_loss" not in runs[1][0]


def test_bf16_with_checkpointing_and_mixed_stages(world, dirs, tmp_path: Path) -> None:
    """Mixed precision and activation checkpointing in actor and critic, critic at ZeRO-2, reference and reward
    model at ZeRO-0 and 1: the run completes with finite metrics; rounding may flip sampled tokens, so the
    bf16 numbers only stay in the fp32 run's range."""
    knobs = {
        "actor_gradient_checkpointing": True,
        "critic_gradient_checkpointing": True,
        "critic_zero_stage": 2,
        "reference_zero_stage": 0,
        "reward_zero_stage": 1,
    }
    pool = world(2)
    fp32 = pool.run(step3_run, _settings(dirs, tmp_path / "fp32", 2, **knobs))[0]["history"]
    bf16 = pool.run(step3_run, _settings(dirs, tmp_path / "bf16", 2, dtype="bf16", **knobs))[0]["history"]
    for a, b in zip(fp32, bf16):
        assert all(math.isfinite(v) for v in b.values())
        assert abs(a["reward"] - b["reward"]) < 0.5 and abs(a["answer_len"] - b["answer_len"]) < 2.0

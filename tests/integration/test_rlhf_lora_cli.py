"""DeepSpeed-Chat's LoRA flags through the real command line at world 2: step 1 (SFT) and step 3 (PPO) train a
few steps with adapters on the tiny Llama's ``layers.`` (DS-Chat's default substring ``decoder.layers.`` is OPT's),
and save plain (merged) HF directories."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.workers.rlhf_runs import make_model_dirs

_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HYBRIDZERO_TIMEOUT_S": "120"}

pytestmark = pytest.mark.timeout(900)


def _run(argv: list[str], cwd: Path, timeout: int = 420) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hybridzero", *argv],
        cwd=cwd,
        env=_ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _no_adapters_saved(model_dir: Path) -> None:
    from safetensors import safe_open

    files = list(model_dir.glob("*.safetensors"))
    assert files
    for f in files:
        with safe_open(str(f), "pt") as h:
            assert not any("lora" in k for k in h.keys())


@pytest.mark.slow
def test_step1_with_lora_flags(tmp_path: Path) -> None:
    out = tmp_path / "sft"
    argv = [
        "sft",
        "--world_size",
        "2",
        "--data_path",
        "demo",
        "--model_name_or_path",
        "demo",
        "--per_device_train_batch_size",
        "4",
        "--max_seq_len",
        "32",
        "--max_steps",
        "2",
        "--lora_dim",
        "4",
        "--lora_module_name",
        "layers.",
        "--only_optimize_lora",
        "--lora_learning_rate",
        "1e-3",
        "--output_dir",
        str(out),
        "--progress",
        "false",
        "--enable_tensorboard",
        "false",
    ]
    proc = _run(argv, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if r.get("phase") == "sft"][-1] == 2
    _no_adapters_saved(out)


@pytest.mark.slow
def test_step2_with_lora_flags_trains_adapters_and_the_head(tmp_path: Path) -> None:
    actor, _ = make_model_dirs(tmp_path / "models")
    out = tmp_path / "rm"
    argv = [
        "reward",
        "--world_size",
        "2",
        "--data_path",
        "demo",
        "--model_name_or_path",
        actor,
        "--per_device_train_batch_size",
        "4",
        "--max_seq_len",
        "32",
        "--max_steps",
        "2",
        "--lora_dim",
        "4",
        "--lora_module_name",
        "layers.",
        "--only_optimize_lora",
        "--output_dir",
        str(out),
        "--progress",
        "false",
        "--enable_tensorboard",
        "false",
    ]
    proc = _run(argv, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if r.get("phase") == "reward"][-1] == 2
    _no_adapters_saved(out)


@pytest.mark.slow
def test_step3_with_actor_and_critic_lora_flags(tmp_path: Path) -> None:
    actor, value = make_model_dirs(tmp_path / "models")
    argv = [
        "ppo",
        "--world_size",
        "2",
        "--data_path",
        "demo",
        "--actor_model_name_or_path",
        actor,
        "--critic_model_name_or_path",
        value,
        "--per_device_generation_batch_size",
        "4",
        "--per_device_training_batch_size",
        "2",
        "--max_answer_seq_len",
        "6",
        "--max_prompt_seq_len",
        "8",
        "--actor_lora_dim",
        "4",
        "--actor_lora_module_name",
        "layers.",
        "--critic_lora_dim",
        "4",
        "--critic_lora_module_name",
        "layers.",
        "--only_optimize_lora",
        "--actor_lora_learning_rate",
        "1e-3",
        "--critic_lora_learning_rate",
        "1e-3",
        "--enable_mixed_precision_lora",
        "--enable_hybrid_engine",
        "--enable_ema",
        "--max_steps",
        "2",
        "--output_dir",
        str(tmp_path / "ppo"),
        "--progress",
        "false",
        "--enable_tensorboard",
        "false",
    ]
    proc = _run(argv, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in (tmp_path / "ppo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    _no_adapters_saved(tmp_path / "ppo" / "actor")

"""End to end through the real command line under torch.distributed.run: the embedded demos (quick mode: reverse
and arithmetic) and a DeepSpeed-Chat-style step-3 command line at world 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.demo_common import check_arith_quick_summary, run_cli
from tests.workers.rlhf_runs import make_model_dirs


@pytest.mark.slow
def test_demo_quick_runs_all_three_steps_at_world_2(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = run_cli(["demo", "--quick", "--output_dir", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2
    for policy in ("sft (greedy)", "sft (sampled)", "ppo (greedy)", "ppo (sampled)", "ppo ema (sampled)"):
        assert set(summary["evaluation"][policy]) == {"rule_exact", "rule_partial", "copy_rate", "reward"}
    assert 0.0 <= summary["reward"]["eval_accuracy"] <= 1.0
    assert all(Path(p).is_file() and Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in summary["plots"])
    for name in ("actor", "actor_ema", "critic"):
        assert (out / "step3_ppo" / name / "config.json").is_file()
    assert "rule exact" in proc.stdout and "plots:" in proc.stdout and "final models:" in proc.stdout


@pytest.mark.slow
def test_arithmetic_demo_quick_runs_sft_and_grpo_at_world_2(tmp_path: Path) -> None:
    out = tmp_path / "arith"
    proc = run_cli(["demo", "--task", "arithmetic", "--quick", "--output_dir", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    check_arith_quick_summary(summary, proc.stdout, out, world=2)
    assert summary["rollout_engine"] == "hf" and summary["vllm_syncs"] is None  # the default engine


@pytest.mark.slow
def test_deepspeed_chat_style_ppo_command_line(tmp_path: Path) -> None:
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
        "--num_padding_at_beginning",
        "1",
        "--per_device_generation_batch_size",
        "4",
        "--per_device_training_batch_size",
        "2",
        "--generation_batches",
        "1",
        "--ppo_epochs",
        "2",
        "--max_answer_seq_len",
        "6",
        "--max_prompt_seq_len",
        "8",
        "--actor_learning_rate",
        "1e-3",
        "--critic_learning_rate",
        "1e-3",
        "--num_warmup_steps",
        "1",
        "--deepspeed",
        "--enable_hybrid_engine",
        "--actor_zero_stage",
        "3",
        "--critic_zero_stage",
        "2",
        "--enable_ema",
        "--enable_test_mode",
        "--test_stop_step",
        "2",
        "--dtype",
        "fp32",
        "--output_dir",
        str(tmp_path / "ppo"),
        "--progress",
        "false",
    ]
    proc = run_cli(argv, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "End-to-End => Latency" in proc.stdout and "Average reward score" in proc.stdout
    lines = [json.loads(x) for x in (tmp_path / "ppo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2] and all(r["phase"] == "ppo" for r in lines)
    plot = run_cli(["plot", str(tmp_path / "ppo")], tmp_path, timeout=120)
    assert plot.returncode == 0 and "PNG" in plot.stdout, plot.stderr

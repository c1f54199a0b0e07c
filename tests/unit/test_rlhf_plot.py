"""plot_run (hybridzero.rlhf.plot) on a synthetic run directory; PNGs checked with the test decoder."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hybridzero.rlhf.plot import ChartSpec, fold_eval_phases, plan_charts, plot_run
from hybridzero.viz.png import PALETTE
from tests.unit.test_viz_png import read_png


def _write_run(run_dir: Path) -> None:
    """Lines shaped like the trainers': ``sft`` / ``sft_eval``, ``reward`` / ``reward_eval``, ``ppo``."""
    lines: list[dict[str, object]] = []
    for step in range(1, 21):
        lines.append({"phase": "sft", "step": step, "time": 0.0, "loss": 3.0 / step, "weird_metric": step % 3})
        if step % 5 == 0:
            lines.append({"phase": "sft_eval", "step": step, "time": 0.0, "eval_loss": 3.5 / step,
                          "perplexity": math.exp(3.5 / step)})
            lines.append({"phase": "reward_eval", "step": step, "time": 0.0, "eval_accuracy": 0.6})
        lines.append({"phase": "reward", "step": step, "time": 0.0, "loss": 0.7 - step / 100,
                      "accuracy": 0.5 + step / 50})
        lines.append({"phase": "ppo", "step": step, "time": 0.0, "reward": math.sin(step), "ema_reward": 0.1 * step,
                      "kl": "nan" if step == 7 else 0.01 * step, "actor_loss": -0.1, "critic_loss": 0.2,
                      "samples_per_s": 4.0, "e2e_tflops": 1.0, "gen_tflops": 0.5, "note": "text",
                      "e2e_s": 2.0, "e2e_latency_s": 2.0, "global_batch_size": 8.0, "critic_params_b": "nan"})
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_plot_run_writes_decodable_pngs(tmp_path: Path) -> None:
    _write_run(tmp_path)
    paths = plot_run(tmp_path)
    names = sorted(p.name for p in paths)
    assert names == sorted([
        "sft_loss.png", "sft_perplexity.png", "sft_weird_metric.png",
        "reward_loss.png", "reward_accuracy.png",
        "ppo_reward.png", "ppo_kl.png", "ppo_losses.png", "ppo_throughput.png", "ppo_tflops.png", "ppo_latency.png",
    ])
    for path in paths:
        assert path.parent == tmp_path / "plots"
        image = read_png(path)
        assert (image.width, image.height) == (640, 400)
        assert PALETTE[0] in image.colors()
    assert PALETTE[1] in read_png(tmp_path / "plots" / "sft_loss.png").colors()  # eval_loss is the 2nd series
    assert PALETTE[1] in read_png(tmp_path / "plots" / "reward_accuracy.png").colors()  # eval_accuracy


def test_fold_eval_phases() -> None:
    records = [{"phase": "sft_eval", "step": 5, "time": 1.0, "eval_loss": 2.0, "perplexity": 7.0},
               {"phase": "sft", "step": 5, "time": 1.0, "loss": 1.0}]
    assert fold_eval_phases(records) == [
        {"phase": "sft", "step": 5, "time": 1.0, "eval_loss": 2.0, "eval_perplexity": 7.0},
        {"phase": "sft", "step": 5, "time": 1.0, "loss": 1.0},
    ]
    assert plan_charts(fold_eval_phases(records)) == [
        ChartSpec("sft", "loss", ("loss", "eval_loss")),
        ChartSpec("sft", "perplexity", ("eval_perplexity",)),
    ]


def test_plan_groups_and_out_dir(tmp_path: Path) -> None:
    records = [{"phase": "grpo", "step": 1, "time": 0.0, "reward": 1.0, "rule_score": 0.5, "ptx_loss": 2.0,
                "flag": True}]
    assert plan_charts(records) == [
        ChartSpec("grpo", "reward", ("reward", "rule_score")),
        ChartSpec("grpo", "losses", ("ptx_loss",)),
    ]
    _write_run(tmp_path / "run")
    out = tmp_path / "elsewhere"
    paths = plot_run(tmp_path / "run", out)
    assert paths and all(p.parent == out for p in paths)
    assert ChartSpec("a b", "c/d", ("x",)).file_name == "a_b_c_d.png"


def test_missing_metrics_names_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"metrics\.jsonl") as info:
        plot_run(tmp_path / "nope")
    assert str(tmp_path / "nope") in str(info.value)


def test_empty_metrics_file(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("")
    assert plot_run(tmp_path) == []

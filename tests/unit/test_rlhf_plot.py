"""plot_run (hybridzero.rlhf.runlog.plot) on a synthetic run directory: the planned figures and panels, and real
PNGs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hybridzero.rlhf.runlog.plot import ChartSpec, Panel, ema_smooth, fold_eval_phases, plan_charts, plot_run

matplotlib = pytest.importorskip("matplotlib")  # the `plots` extra
mpimg = pytest.importorskip("matplotlib.image")


def _write_run(run_dir: Path) -> None:
    """Lines shaped like the trainers': ``sft`` / ``sft_eval``, ``reward`` / ``reward_eval``, ``ppo``."""
    lines: list[dict[str, object]] = []
    for step in range(1, 21):
        lines.append({"phase": "sft", "step": step, "time": 0.0, "loss": 3.0 / step, "weird_metric": step % 3})
        if step % 5 == 0:
            lines.append(
                {
                    "phase": "sft_eval",
                    "step": step,
                    "time": 0.0,
                    "eval_loss": 3.5 / step,
                    "perplexity": math.exp(3.5 / step),
                }
            )
            lines.append({"phase": "reward_eval", "step": step, "time": 0.0, "eval_accuracy": 0.6})
        lines.append(
            {"phase": "reward", "step": step, "time": 0.0, "loss": 0.7 - step / 100, "accuracy": 0.5 + step / 50}
        )
        lines.append(
            {
                "phase": "ppo",
                "step": step,
                "time": 0.0,
                "reward": math.sin(step),
                "ema_reward": 0.1 * step,
                "rule_score": step / 40,
                "kl": "nan" if step == 7 else 0.01 * step,
                "actor_loss": -0.1,
                "critic_loss": 0.2,
                "samples_per_s": 4.0,
                "e2e_tflops": 1.0,
                "gen_tflops": 0.5,
                "note": "text",
                "e2e_s": 2.0,
                "e2e_latency_s": 2.0,
                "global_batch_size": 8.0,
                "critic_params_b": "nan",
            }
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_plot_run_writes_decodable_pngs(tmp_path: Path) -> None:
    _write_run(tmp_path)
    paths = plot_run(tmp_path)
    names = sorted(p.name for p in paths)
    assert names == sorted(
        [
            "sft_loss.png",
            "sft_perplexity.png",
            "sft_weird_metric.png",
            "reward_loss.png",
            "reward_accuracy.png",
            "ppo_reward.png",
            "ppo_kl.png",
            "ppo_losses.png",
            "ppo_throughput.png",
            "ppo_tflops.png",
            "ppo_latency.png",
        ]
    )
    for path in paths:
        assert path.parent == tmp_path / "plots"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        image = mpimg.imread(path)  # [H, W, 4] floats
        assert image.shape[1] == 800 and image.shape[0] >= 300
        colors = {tuple(px) for px in (image[::4, ::4, :3] * 255).round().reshape(-1, 3).tolist()}
        assert len(colors) > 20  # lines, text and antialiasing: not a blank canvas
    tab = [tuple(round(c * 255) for c in matplotlib.colors.to_rgb(f"C{i}")) for i in range(2)]
    sft_loss = {
        tuple(px)
        for px in (mpimg.imread(tmp_path / "plots" / "sft_loss.png")[..., :3] * 255)
        .round()
        .reshape(-1, 3)
        .astype(int)
        .tolist()
    }
    assert tab[0] in sft_loss and tab[1] in sft_loss  # loss and eval_loss drawn in their own colours
    ppo_reward = mpimg.imread(tmp_path / "plots" / "ppo_reward.png")
    assert ppo_reward.shape[0] > mpimg.imread(tmp_path / "plots" / "ppo_kl.png").shape[0]  # two stacked panels


def test_reward_and_a_rate_never_share_an_axis() -> None:
    records = [
        {
            "phase": "ppo",
            "step": s,
            "time": 0.0,
            "reward": 1.5,
            "ema_reward": 1.4,
            "rule_score": 0.3,
            "copy_rate": 0.4,
            "actor_loss": 0.1,
            "critic_loss": 0.2,
        }
        for s in (1, 2)
    ]
    charts = {c.name: c for c in plan_charts(records)}
    assert charts["reward"].panels == (
        Panel("reward model score", "score", ("reward", "ema_reward")),
        Panel("hidden rule (never seen in training)", "fraction (0-1)", ("rule_score", "copy_rate")),
    )
    assert [p.keys for p in charts["losses"].panels] == [("actor_loss",), ("critic_loss",)]


def test_ema_smooth() -> None:
    assert ema_smooth([1.0, 2.0, 3.0], 0.0) == [1.0, 2.0, 3.0]
    out = ema_smooth([2.0, math.nan, 4.0], 0.5)
    assert out[0] == 2.0 and math.isnan(out[1]) and out[2] == pytest.approx((0.25 * 2 + 0.5 * 4) / 0.75)


def test_fold_eval_phases() -> None:
    records = [
        {"phase": "sft_eval", "step": 5, "time": 1.0, "eval_loss": 2.0, "perplexity": 7.0},
        {"phase": "sft", "step": 5, "time": 1.0, "loss": 1.0},
    ]
    assert fold_eval_phases(records) == [
        {"phase": "sft", "step": 5, "time": 1.0, "eval_loss": 2.0, "eval_perplexity": 7.0},
        {"phase": "sft", "step": 5, "time": 1.0, "loss": 1.0},
    ]
    assert plan_charts(fold_eval_phases(records)) == [
        ChartSpec(
            "sft",
            "loss",
            (Panel("language-model loss (training and held-out)", "nats per token", ("loss", "eval_loss")),),
        ),
        ChartSpec("sft", "perplexity", (Panel("perplexity", "perplexity", ("eval_perplexity",)),)),
    ]


def test_plan_groups_and_out_dir(tmp_path: Path) -> None:
    records = [
        {"phase": "grpo", "step": 1, "time": 0.0, "reward": 1.0, "rule_score": 0.5, "ptx_loss": 2.0, "flag": True}
    ]
    assert plan_charts(records) == [
        ChartSpec(
            "grpo",
            "reward",
            (
                Panel("reward model score", "score", ("reward",)),
                Panel("hidden rule (never seen in training)", "fraction (0-1)", ("rule_score",)),
            ),
        ),
        ChartSpec("grpo", "losses", (Panel("unsupervised (ptx) loss", "nats per token", ("ptx_loss",)),)),
    ]
    _write_run(tmp_path / "run")
    out = tmp_path / "elsewhere"
    paths = plot_run(tmp_path / "run", out)
    assert paths and all(p.parent == out for p in paths)
    assert ChartSpec("a b", "c/d", (Panel("x", "x", ("x",)),)).file_name == "a_b_c_d.png"


def test_missing_metrics_names_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"metrics\.jsonl") as info:
        plot_run(tmp_path / "nope")
    assert str(tmp_path / "nope") in str(info.value)


def test_empty_metrics_file(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("")
    assert plot_run(tmp_path) == []

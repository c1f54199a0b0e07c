"""Smoke tests of ``bench/train_demo.py`` and ``bench/bench_zero3.py`` on the tiny model.

Each launches real gloo ranks through ``torch.distributed.run`` as a subprocess (about 20 s on 2 CPU cores). They
check the shape of the output only; no timing is asserted anywhere.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import torch
from bench_model import benchmark_llama, synthetic_batches, tiny_overrides
from train_demo import build_parser

from hybridzero.cli import main

REPO = Path(__file__).resolve().parents[2]
STEP_LINE = re.compile(
    r"^step\s+(\d+)/(\d+) \| loss\s+(\S+) \| lr (\S+) \| grad\s+(\S+) \|.* ms \|.* tok/s \| "
    r"AG\s+\S+ MB \| RS\s+\S+ MB$"
)
TIMEOUT_S = 300


def _env() -> dict[str, str]:
    """This environment without torchrun's variables, so the commands take their launcher path."""
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
    return {k: v for k, v in os.environ.items() if k not in drop}


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """Run ``python argv`` from the repository root; fail the test with its output unless it exits 0."""
    proc = subprocess.run(
        [sys.executable, *argv], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-6000:]}"
    return proc


def test_train_demo_prints_steps_and_summary() -> None:
    """Two ranks, two steps: exactly two well-formed step lines from rank 0, then the summary."""
    proc = _run([str(REPO / "bench" / "train_demo.py"), "--world-size", "2", "--steps", "2", "--tiny"])
    lines = proc.stdout.splitlines()
    steps = [m for m in (STEP_LINE.match(line) for line in lines) if m]
    assert [(m.group(1), m.group(2)) for m in steps] == [("1", "2"), ("2", "2")], proc.stdout
    for m in steps:
        assert math.isfinite(float(m.group(3))) and math.isfinite(float(m.group(5)))
    summary = [line for line in lines if line.startswith("summary:")]
    assert summary and "loss" in summary[0] and any("all-gather" in line for line in summary), proc.stdout


def test_bench_zero3_writes_results(tmp_path: Path) -> None:
    """One measured step at world 2: zero3.json has metadata and a floor and a ZeRO-3 row with every metric."""
    out = tmp_path / "results"
    proc = _run([str(REPO / "bench" / "bench_zero3.py"), "--steps", "1", "--worlds", "2", "--tiny", "--out", str(out)])
    report = json.loads((out / "zero3.json").read_text())
    assert {"date", "machine", "versions", "git", "settings", "results"} <= set(report)
    assert {"cpu_count", "platform"} <= set(report["machine"])
    assert {"torch", "transformers"} <= set(report["versions"])
    rows = report["results"]
    assert [(r["system"].split(":")[0], r["world_size"]) for r in rows] == [("floor", 1), ("hybridzero ZeRO-3", 2)]
    keys = {
        "median_step_ms",
        "p10_step_ms",
        "p90_step_ms",
        "all_gather_bytes_per_step",
        "all_gather_calls_per_step",
        "reduce_scatter_bytes_per_step",
        "reduce_scatter_calls_per_step",
        "peak_rss_mib_per_rank",
        "final_loss",
        "step_time_vs_floor",
        "peak_rss_vs_floor",
    }
    for row in rows:
        assert keys <= set(row), sorted(keys - set(row))
    zero3 = rows[1]
    assert zero3["all_gather_bytes_per_step"] > 0 and zero3["reduce_scatter_calls_per_step"] >= 1
    assert len(zero3["peak_rss_mib_per_rank"]) == 2
    assert (out / "zero3.md").read_text().count("\n| ") >= 3
    assert "| hybridzero ZeRO-3 | 2 |" in proc.stdout


def test_cli_without_subcommand_is_usage_error() -> None:
    """No subcommand prints usage and returns 2; the train demo's defaults are the documented ones."""
    assert main([]) == 2
    args = build_parser().parse_args([])
    assert (args.world_size, args.steps, args.dtype, args.tiny) == (2, 30, "fp32", False)


def test_bench_model_is_deterministic_and_cycles_a_pool() -> None:
    """Same seed, same weights and data; the data repeats its pool of sequences (what makes it learnable)."""
    a = benchmark_llama(3, **tiny_overrides())
    b = benchmark_llama(3, **tiny_overrides())
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    batches = synthetic_batches(1, steps=4, world_size=2, vocab_size=512, pool_size=16)
    assert batches.shape == (4, 2, 4, 64) and int(batches.max()) < 512
    assert torch.equal(batches, synthetic_batches(1, steps=4, world_size=2, vocab_size=512, pool_size=16))
    assert torch.equal(batches[2], batches[0])  # 16 sequences = 2 steps of 2 ranks x 4 rows
    assert not torch.equal(batches[1], batches[0])

"""Smoke test of ``bench/bench_rl_peers.py --quick``: our GRPO step and TRL's GRPOTrainer on the same work.

One driver run at world 2 (a quick SFT, then one round of 2 iterations per side, each final model scored on 64
held-out prompts). Skipped when ``trl`` is not importable: CI does not install the ``bench`` extra. Only the shape
of the output and its consistency are checked, never a time.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("trl") is None,
        reason="trl is not installed (the 'bench' extra: pip install -e '.[bench]'); CI does not install it",
    ),
]


def test_quick_run_writes_consistent_results(tmp_path: Path) -> None:
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in drop} | {"OMP_NUM_THREADS": "1"}
    argv = [sys.executable, str(REPO / "bench" / "bench_rl_peers.py"), "--quick", "--worlds", "2"]
    argv += ["--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=400, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "out" / "rl_peers_quick.json").read_text())
    assert [(r["side"], r["world"]) for r in res["runs"]] == [("ours", 2), ("trl", 2)]
    for run in res["runs"]:
        assert run["completions"] == 2 * 128  # 2 iterations of 16 prompts x 8 completions, both sides
        assert run["samples_per_s"] == pytest.approx(run["completions"] / run["loop_s"])
        assert 0 < run["loop_s"] < run["process_s"]
        assert 0.0 <= run["exact_greedy"] <= 1.0 and 0.0 <= run["exact_sampled"] <= 1.0
    (ratio,) = res["ratios"]
    ours, trl = res["runs"]
    assert ratio["samples_per_s_ratio"] == pytest.approx(ours["samples_per_s"] / trl["samples_per_s"])
    assert ratio["exact_greedy_diff"] == pytest.approx(ours["exact_greedy"] - trl["exact_greedy"])
    assert "ours/TRL samples/s" in (tmp_path / "out" / "rl_peers_quick.md").read_text()
    png = tmp_path / "out" / "rl_peers_quick.png"
    assert not res.get("plot", True) or png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

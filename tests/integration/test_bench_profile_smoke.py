"""Smoke test of ``bench/bench_profile.py``: the tiny model, floor + world 1 + world 2, fp32, two steps. The bench's
own accounting check (parts within 5% of each step) must pass; the report's shape is checked, never a time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_profile_runs_and_its_parts_account_for_every_step(tmp_path: Path) -> None:
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    argv = [sys.executable, str(REPO / "bench" / "bench_profile.py"), "--model", "tiny", "--steps", "2"]
    argv += ["--warmup", "1", "--worlds", "1", "2", "--dtypes", "fp32", "--out", str(tmp_path)]
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=140, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-6000:]}"
    report = json.loads((tmp_path / "profile.json").read_text())
    assert report["accounting_failures"] == []
    rows = {(r["system"], r["world_size"]): r for r in report["results"]}
    assert set(rows) == {("floor", 0), ("hybridzero", 1), ("hybridzero", 2)}
    w2 = rows[("hybridzero", 2)]
    assert w2["parts_ms"]["compute"] > 0 and w2["parts_ms"]["optimizer"] > 0
    assert {"all_gather", "reduce_scatter"} <= set(w2["comm_and_wait_by_collective_ms"])
    assert rows[("floor", 0)]["parts_ms"]["comm"] == 0.0  # the floor has no collectives
    assert "| hybridzero W2 | fp32 |" in (tmp_path / "profile.md").read_text()

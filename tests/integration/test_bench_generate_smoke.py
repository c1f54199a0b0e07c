"""Smoke tests of ``bench/bench_generate.py``'s generation peers and of ``bench/run_all.py``.

The generate test runs plain ``generate``, tensor-parallel hybrid generation and the FSDP2 and DeepSpeed peers once
each (tiny model, world 2, 4 new tokens, about 20 s on 2 CPU cores); DeepSpeed's row is only required when
``deepspeed`` is importable (the driver skips it otherwise and records why). The ``run_all`` summary writer is checked
on hand-made records (no process), and one slow test runs ``run_all.py --quick`` for one part end to end. Only shapes
are checked, never a time.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 110


def _env() -> dict[str, str]:
    """This environment without torchrun's variables."""
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
    return {k: v for k, v in os.environ.items() if k not in drop}


def _run(argv: list[str], timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run ``python argv`` from the repository root; fail with its output unless it exits 0."""
    proc = subprocess.run(
        [sys.executable, *argv], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-6000:]}"
    return proc


@pytest.mark.timeout(150)
def test_generate_peers(tmp_path: Path) -> None:
    """FSDP2 unshard-then-generate (and DeepSpeed ZeRO-3 when installed) produce plain generate's tokens."""
    _run(
        [
            str(REPO / "bench" / "bench_generate.py"),
            "--tiny",
            "--world",
            "2",
            "--batch",
            "2",
            "--prompt-len",
            "8",
            "--new-tokens",
            "4",
            "--repeats",
            "1",
            "--systems",
            "hybrid-tp",
            "fsdp2",
            "deepspeed",
            "--out",
            str(tmp_path),
        ]
    )
    report = json.loads((tmp_path / "generate.json").read_text())
    rows: dict[str, dict[str, Any]] = {r["system"].split()[0]: r for r in report["results"]}
    expected = {"plain", "hybrid", "fsdp2"} | ({"deepspeed"} if "deepspeed" in report["metadata"]["systems"] else set())
    assert set(rows) == expected, rows.keys()
    if "deepspeed" not in expected:
        assert "deepspeed" in report["metadata"]["skipped"]
    assert rows["plain"]["time_vs_plain"] == 1.0
    for name in expected - {"plain"}:
        row = rows[name]
        assert row["world_size"] == 2 and row["tokens_match_plain"] is True, row
        assert math.isfinite(row["tokens_per_s_per_rank"]) and row["tokens_per_s_vs_plain"] > 0
        assert row["forwards"] == 4 and row["all_gather_calls"] >= 1 and row["all_gather_mb"] > 0
    assert rows["fsdp2"]["all_gather_calls"] == 3  # one unshard per FSDP group (2 blocks + root), none while decoding
    assert rows["hybrid"]["system"] == "hybrid engine, tensor-parallel" and 0 < rows["hybrid"]["held_mb"]
    assert "fsdp2" in (tmp_path / "generate.md").read_text()


def _bench_module(name: str) -> Any:
    """Import ``bench/<name>.py`` (the bench directory is not a package)."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(REPO / "bench"))


def test_run_all_summary_markdown(tmp_path: Path) -> None:
    """Parts' tables are gathered, chart links of a part in a subdirectory are rewritten, failures are shown."""
    run_all = _bench_module("run_all")
    meta = run_all.metadata(quick=True)
    assert {"platform", "cpu_count"} <= set(meta["machine"])
    assert {"torch", "transformers", "deepspeed", "hybridzero"} == set(meta["versions"])
    ok = {
        "name": "peers_100m",
        "command": ["python", "x.py"],
        "returncode": 0,
        "seconds": 3.0,
        "out_dir": str(tmp_path / "peers_100m"),
        "report": {"plots": [{"path": "peers_loss_w2_fp32.png"}]},
        "markdown": "# title\n\n| a |\n|---|\n\n![loss](peers_loss_w2_fp32.png)",
    }
    bad = {
        "name": "zeropp",
        "command": ["python", "y.py"],
        "returncode": 2,
        "seconds": 1.0,
        "out_dir": str(tmp_path),
        "error_tail": "Traceback: boom",
    }
    text = run_all.summary_markdown(meta, [ok, bad], tmp_path)
    assert "](peers_100m/peers_loss_w2_fp32.png)" in text and "### title" in text
    assert "**FAILED** (exit 2)" in text and "boom" in text
    names = [part.name for part in run_all.plan(tmp_path, quick=False)]
    assert names == list(run_all.PARTS)
    big = next(p for p in run_all.plan(tmp_path, quick=False) if p.name == "peers_100m")
    assert big.argv[big.argv.index("--model") + 1] == "100m"


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_run_all_quick_one_part(tmp_path: Path) -> None:
    """``run_all.py --quick --only zeropp`` writes summary.md and summary.json with the part's report."""
    _run([str(REPO / "bench" / "run_all.py"), "--quick", "--only", "zeropp", "--out", str(tmp_path)], timeout=130)
    summary = json.loads((tmp_path / "quick" / "summary.json").read_text())
    assert summary["quick"] is True and [p["name"] for p in summary["parts"]] == ["zeropp"]
    assert summary["parts"][0]["returncode"] == 0 and summary["parts"][0]["report"]["rows"]
    assert "| hpz |" in (tmp_path / "quick" / "summary.md").read_text()

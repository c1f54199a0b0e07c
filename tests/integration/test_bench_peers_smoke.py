"""Smoke test of ``bench/bench_peers.py``: one step of every system at world 2 on the tiny model.

One driver run (three ``torch.distributed.run`` launches, about 30 s on 2 CPU cores) is shared by the tests below.
The DeepSpeed test is skipped when ``deepspeed`` is not importable (the driver then leaves it out and runs
hybridzero and FSDP2 only), and their test still runs. Only the shape of the output and the loss agreement are
checked, never a time.
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
DRIVER_TIMEOUT_S = 85


def _env() -> dict[str, str]:
    """This environment without torchrun's variables, so each launch starts its own rendezvous."""
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
    return {k: v for k, v in os.environ.items() if k not in drop}


@pytest.fixture(scope="module")
def peers_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``peers.json`` of one tiny run: world 2, fp32, one step (no warm-up), one round."""
    out = tmp_path_factory.mktemp("peers")
    argv = [sys.executable, str(REPO / "bench" / "bench_peers.py"), "--tiny", "--worlds", "2", "--steps", "1",
            "--warmup", "0", "--repeats", "1", "--curve-steps", "1", "--out", str(out)]
    proc = subprocess.run(argv, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=DRIVER_TIMEOUT_S,
                          check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-6000:]}"
    assert (out / "peers.md").read_text().count("\n| ") >= 3
    return json.loads((out / "peers.json").read_text())


def _row(report: dict[str, Any], system: str) -> dict[str, Any]:
    """The single result row of ``system``."""
    rows = [r for r in report["results"] if r["system"] == system]
    assert len(rows) == 1, report["results"]
    return rows[0]


@pytest.mark.timeout(120)
def test_hybridzero_and_fsdp2_rows(peers_report: dict[str, Any]) -> None:
    """Both always-available systems ran one step with finite loss, RSS per rank and counted collectives."""
    assert {"date", "machine", "versions", "settings", "results", "loss_agreement"} <= set(peers_report)
    for system in ("hybridzero", "fsdp2"):
        row = _row(peers_report, system)
        assert row["world_size"] == 2 and row["dtype"] == "fp32"
        assert math.isfinite(row["final_loss"]) and row["median_step_ms"] > 0
        assert len(row["peak_rss_mib_per_rank"]) == 2
        assert row["collectives_per_step"]["all_gather"]["bytes"] > 0
        assert row["collectives_per_step"]["reduce_scatter"]["calls"] >= 1
    check = peers_report["loss_agreement"][0]
    assert check["max_abs_diff"]["fsdp2"] <= 1e-4, check


@pytest.mark.timeout(120)
def test_deepspeed_row(peers_report: dict[str, Any]) -> None:
    """DeepSpeed ZeRO-3 ran one step whose loss matches hybridzero's, with its comms logger's counts."""
    if "deepspeed" not in peers_report["settings"]["systems"]:
        pytest.skip("deepspeed is not importable, so the driver skipped it "
                    "(install with: DS_BUILD_OPS=0 pip install '.[bench]')")
    row = _row(peers_report, "deepspeed")
    assert row["world_size"] == 2 and math.isfinite(row["final_loss"])
    assert row["collectives_per_step"]["reduce_scatter"]["calls"] >= 1
    assert peers_report["versions"]["deepspeed"]
    assert peers_report["loss_agreement"][0]["max_abs_diff"]["deepspeed"] <= 1e-4

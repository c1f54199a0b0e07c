"""Smoke test of ``bench/bench_peers.py``: one step of every system at world 2 on the tiny model.

One driver run (three ``torch.distributed.run`` launches, about 30 s on 2 CPU cores) is shared by the tests below;
it also writes the PNG charts, whose files are checked. A slow test runs hpZ (``--hpz 2``) at world 4, and a fast one
pins the ~100 M-parameter variant's exact size (on the meta device, nothing allocated).
The DeepSpeed test is skipped when ``deepspeed`` is not importable (the driver then leaves it out and runs
hybridzero and FSDP2 only), and their test still runs. Only the shape of the output and the loss agreement are
checked, never a time.
"""

from __future__ import annotations

import importlib
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


def _run_driver(out: Path, *extra: str, timeout: float = DRIVER_TIMEOUT_S) -> dict[str, Any]:
    """Run ``bench_peers.py`` with one step, no warm-up, one round and ``extra``; its ``peers.json``."""
    argv = [
        sys.executable,
        str(REPO / "bench" / "bench_peers.py"),
        "--steps",
        "1",
        "--warmup",
        "0",
        "--repeats",
        "1",
        "--curve-steps",
        "1",
        "--out",
        str(out),
        *extra,
    ]
    proc = subprocess.run(argv, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-6000:]}"
    assert (out / "peers.md").read_text().count("\n| ") >= 3
    return json.loads((out / "peers.json").read_text())


@pytest.fixture(scope="module")
def peers_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output directory of one tiny run: world 2, fp32, one step (no warm-up), one round, charts on."""
    out = tmp_path_factory.mktemp("peers")
    _run_driver(out, "--tiny", "--worlds", "2")
    return out


@pytest.fixture(scope="module")
def peers_report(peers_out: Path) -> dict[str, Any]:
    """``peers.json`` of the tiny run."""
    return json.loads((peers_out / "peers.json").read_text())


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
        pytest.skip(
            "deepspeed is not importable, so the driver skipped it "
            "(install with: DS_BUILD_OPS=0 pip install '.[bench]')"
        )
    row = _row(peers_report, "deepspeed")
    assert row["world_size"] == 2 and math.isfinite(row["final_loss"])
    assert row["collectives_per_step"]["reduce_scatter"]["calls"] >= 1
    assert peers_report["versions"]["deepspeed"]
    assert peers_report["loss_agreement"][0]["max_abs_diff"]["deepspeed"] <= 1e-4


@pytest.mark.timeout(120)
def test_charts_written(peers_out: Path, peers_report: dict[str, Any]) -> None:
    """A loss chart and a step-time chart for (W=2, fp32), listed in peers.json, are PNG files linked from peers.md."""
    plots = peers_report["plots"]
    kinds = sorted((p["kind"], p["world_size"], p["dtype"]) for p in plots)
    assert kinds == [("loss", 2, "fp32"), ("step_ms", 2, "fp32")]
    markdown = (peers_out / "peers.md").read_text()
    for plot in plots:
        data = (peers_out / plot["path"]).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000, plot
        assert f"]({plot['path']})" in markdown
    assert peers_report["settings"]["model"] == "tiny" and peers_report["settings"]["hpz_partition_size"] == 1


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_hpz_world4(tmp_path: Path) -> None:
    """``--hpz 2`` at world 4: every available system runs a step with hpZ (FSDP2: reshard_after_forward=2) and the
    losses agree."""
    report = _run_driver(tmp_path, "--tiny", "--worlds", "4", "--hpz", "2", "--no-plots", timeout=220)
    assert report["settings"]["hpz_partition_size"] == 2 and report["plots"] == []
    assert {r["system"] for r in report["results"]} == set(report["settings"]["systems"])
    assert report["loss_agreement"][0]["max_abs_diff_overall"] <= 1e-4


def test_100m_variant_size() -> None:
    """The ``100m`` variant has exactly 100,092,672 parameters (counted on the meta device)."""
    import torch
    import transformers
    from bench_model import (
        MODEL_CHOICES,
        model_overrides,
        prefetch_bucket_for,
    )

    assert MODEL_CHOICES == ("bench", "tiny", "100m")
    sys.path.insert(0, str(REPO / "bench"))
    try:
        driver_choices = importlib.import_module("peer_common").MODEL_CHOICES  # the drivers' torch-free copy
    finally:
        sys.path.remove(str(REPO / "bench"))
    assert driver_choices == MODEL_CHOICES
    config = transformers.LlamaConfig(**model_overrides("100m"), tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == 100_092_672
    assert prefetch_bucket_for("100m") > 2 * 6_292_992 > prefetch_bucket_for("bench")
    with pytest.raises(ValueError, match="model must be one of"):
        model_overrides("7b")

"""The arithmetic demo's quick run through the real command line with ``--rollout_engine vllm`` at world 1: GRPO's
rollouts come from one colocated vLLM engine (the demo's tiny Llama has head size 32, which vLLM's CPU attention
accepts), the weights are synced into it once per iteration, and the held-out report passes the same checks as the
default (hf) quick run's (tests/integration/test_rlhf_cli_runs.py). One vLLM engine start in all: the one CLI run's.

The quick run's thresholds are ranges, not margins (12 SFT steps leave the policy near chance); the full demo's
held-out scores on both engines are measured in docs/demo_engines.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.demo_common import check_arith_quick_summary, run_cli

pytest.importorskip("vllm")

pytestmark = pytest.mark.slow


def test_arithmetic_demo_quick_runs_grpo_on_vllm(tmp_path: Path) -> None:
    out = tmp_path / "arith_vllm"
    argv = ["demo", "--task", "arithmetic", "--quick", "--world_size", "1", "--rollout_engine", "vllm"]
    proc = run_cli([*argv, "--output_dir", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    check_arith_quick_summary(summary, proc.stdout, out, world=1)
    assert summary["rollout_engine"] == "vllm"
    assert summary["vllm_syncs"] == summary["grpo_iterations"]  # the actor's weights, before each rollout

"""What the command-line demo tests share: running ``python -m hybridzero`` in a subprocess, and the checks every
quick arithmetic-demo run must pass whatever its rollout engine (the quick run's thresholds: its 12 SFT steps and 2
GRPO iterations leave the policy near chance, so the checks are ranges and identities, not learning margins)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HYBRIDZERO_TIMEOUT_S": "120"}
ARITH_POLICIES: tuple[str, ...] = ("sft (greedy)", "sft (sampled)", "grpo (greedy)", "grpo (sampled)")
ARITH_SCORES: frozenset[str] = frozenset({"exact", "exact_carry", "dropped_carry", "format"})


def run_cli(argv: list[str], cwd: Path, timeout: int = 420) -> subprocess.CompletedProcess[str]:
    """``python -m hybridzero ARGV`` in ``cwd`` (one thread per process), output captured."""
    return subprocess.run(
        [sys.executable, "-m", "hybridzero", *argv],
        cwd=cwd,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def check_arith_quick_summary(summary: dict[str, Any], stdout: str, out: Path, world: int) -> None:
    """A quick arithmetic demo's ``summary.json`` and printout: 2 GRPO iterations at ``world``, every held-out score
    a rate in [0, 1], the gain the difference of the rows it names, the reward the functions' weighted sum, no
    critic, the PNG plots written and the verdict printed."""
    assert summary["task"] == "arithmetic" and summary["world_size"] == world and summary["grpo_iterations"] == 2
    for policy in ARITH_POLICIES:
        scores = summary["evaluation"][policy]
        assert set(scores) == ARITH_SCORES
        assert all(0.0 <= v <= 1.0 for v in scores.values()), scores
    gain = summary["gain_exact"]
    assert gain["greedy"] == pytest.approx(
        summary["evaluation"]["grpo (greedy)"]["exact"] - summary["evaluation"]["sft (greedy)"]["exact"]
    )
    last = summary["grpo_last"]
    assert {"rewards/exact_answer", "rewards/answer_format", "reward"} <= set(last)  # the functions scored
    assert last["reward"] == pytest.approx(last["rewards/exact_answer"] + 0.1 * last["rewards/answer_format"])
    assert "critic" not in summary["models"] and (out / "step3_grpo" / "actor" / "config.json").is_file()
    assert all(Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in summary["plots"]) and summary["plots"]
    assert "GRPO - SFT, greedy" in stdout and "final models:" in stdout

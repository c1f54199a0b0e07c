"""A real fp16 run whose loss scale underflows (issue 28): ``hybridzero sft`` with an absurd learning rate diverges,
every step then overflows, the dynamic scale falls from 2**16 to ``fp16.min_loss_scale`` 1, and the command ends in
one error line naming that key and the step's own flags (exit 1), not a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_sft_fp16_underflow_ends_in_one_line_naming_the_key(tmp_path: Path) -> None:
    argv = ["sft", "--model_name_or_path", "demo", "--data_path", "demo", "--dtype", "fp16"]
    argv += ["--learning_rate", "1e30", "--per_device_train_batch_size", "4", "--max_steps", "60"]
    argv += ["--progress", "false", "--output_dir", str(tmp_path / "out")]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "hybridzero", *argv],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        check=False,
        timeout=600,
    )
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert last.startswith("sft: error: fp16 loss scale already at its minimum"), last
    assert "fp16.min_loss_scale = 1" in last and "--dtype bf16" in last and "--learning_rate" in last, last

"""The engine writes DeepSpeed's monitor events (``Train/Samples/lr``, ``train_loss``, ``samples_per_sec``) at
every optimizer step against ``global_samples``, on rank 0 only, for a config with a ``csv_monitor`` block."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.workers.from_deepspeed import train_with_csv_monitor

CASE = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed_0.19.8" / "zero2_fp32"


@pytest.mark.timeout(300)
def test_engine_steps_write_deepspeed_events(world, tmp_path: Path) -> None:
    losses = world(2).run(train_with_csv_monitor, str(CASE), str(tmp_path), timeout=240)
    record = json.loads((CASE / "record.json").read_text())
    job = tmp_path / "job"
    lr = (job / "Train_Samples_lr.csv").read_text().splitlines()
    assert lr == ["step,lr", f"4,{record['lr'][0]!r}", f"8,{record['lr'][1]!r}"]
    loss = (job / "Train_Samples_train_loss.csv").read_text().splitlines()
    assert [row.split(",")[0] for row in loss] == ["step", "4", "8"]
    assert [float(row.split(",")[1]) for row in loss[1:]] == losses[0]  # rank 0's loss
    rate = (job / "Train_Samples_samples_per_sec.csv").read_text().splitlines()
    assert len(rate) == 3 and all(float(row.split(",")[1]) > 0 for row in rate[1:])
    assert sorted(p.name for p in job.iterdir()) == [
        "Train_Samples_lr.csv",
        "Train_Samples_samples_per_sec.csv",
        "Train_Samples_train_loss.csv",
    ]

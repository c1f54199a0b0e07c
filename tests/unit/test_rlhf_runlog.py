"""RunLog (hybridzero.rlhf.runlog.metrics): rank-0-only writes, strict JSON lines, resume merging, TensorBoard
mirror."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from hybridzero.rlhf.runlog.metrics import RunLog, read_metrics


def _tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of ``run_dir/tensorboard`` as read by the tensorboard package's own EventAccumulator."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        acc = accumulator.EventAccumulator(str(path))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return out


def test_rank0_writes_json_and_tensorboard(tmp_path: Path) -> None:
    echoed: list[str] = []
    with RunLog(tmp_path, 0, echo=echoed.append) as log:
        log.log(1, {"reward": 0.5, "kl": torch.tensor(0.25)}, "ppo")
        log.log(2, {"reward": math.nan, "kl": math.inf, "n": 3}, "ppo")
        log.print("hello")
    assert echoed == ["hello"]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert first["phase"] == "ppo" and first["step"] == 1 and first["reward"] == 0.5 and first["kl"] == 0.25
    assert first["time"] > 1e9
    second = json.loads(lines[1], parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}"))
    assert second["reward"] == "nan" and second["kl"] == "inf"
    records = read_metrics(tmp_path)
    assert math.isnan(records[1]["reward"]) and records[1]["kl"] == math.inf and records[1]["n"] == 3.0
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 1
    scalars = _tensorboard_scalars(tmp_path)
    assert scalars["ppo/reward"][0] == (1, 0.5) and math.isnan(scalars["ppo/reward"][1][1])
    assert scalars["ppo/kl"] == [(1, 0.25), (2, math.inf)] and scalars["ppo/n"] == [(2, 3.0)]


def test_missing_tensorboard_warns_once_and_keeps_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as without the package
    with (
        pytest.warns(UserWarning, match="tensorboard package is not installed") as record,
        RunLog(tmp_path, 0, echo=lambda _: None) as log,
    ):
        log.log(1, {"a": 1.0}, "sft")
        log.log(2, {"a": 2.0}, "sft")
    assert len([w for w in record if "tensorboard" in str(w.message)]) == 1
    assert not (tmp_path / "tensorboard").exists()
    assert [r["a"] for r in read_metrics(tmp_path)] == [1.0, 2.0]


def test_other_ranks_and_no_dir_are_no_ops(tmp_path: Path) -> None:
    echoed: list[str] = []
    with RunLog(tmp_path / "r1", 1, echo=echoed.append) as log:
        log.log(1, {"a": 1.0}, "sft")
        log.print("not shown")
    assert not (tmp_path / "r1").exists() and echoed == []
    with RunLog(None, 0, echo=echoed.append) as log:
        log.log(1, {"a": 1.0}, "sft")
        log.print("shown")
    assert echoed == ["shown"]


def test_no_tensorboard(tmp_path: Path) -> None:
    with RunLog(tmp_path, 0, tensorboard=False, echo=lambda _: None) as log:
        log.log(1, {"a": 1.0}, "sft")
    assert not (tmp_path / "tensorboard").exists()
    assert read_metrics(tmp_path)[0]["a"] == 1.0


def test_reserved_key_rejected(tmp_path: Path) -> None:
    with RunLog(tmp_path, 0, tensorboard=False) as log, pytest.raises(ValueError, match="reserved"):
        log.log(1, {"step": 1.0}, "sft")


def test_resume_appends_and_last_occurrence_wins(tmp_path: Path) -> None:
    with RunLog(tmp_path, 0, echo=lambda _: None) as log:
        for step in (1, 2, 3):
            log.log(step, {"loss": float(step)}, "sft")
    with (tmp_path / "metrics.jsonl").open("a") as handle:
        handle.write('{"phase": "sft", "st')  # a crash mid-line
    with RunLog(tmp_path, 0, echo=lambda _: None) as log:  # resumed from the step-2 checkpoint
        log.log(3, {"loss": 30.0}, "sft")
        log.log(3, {"eval_loss": 31.0}, "sft")
        log.log(4, {"loss": 40.0}, "sft")
    with pytest.warns(UserWarning, match="1 malformed"):
        records = read_metrics(tmp_path)
    assert [(r["step"], r.get("loss"), r.get("eval_loss")) for r in records] == [
        (1, 1.0, None),
        (2, 2.0, None),
        (3, 30.0, 31.0),
        (4, 40.0, None),
    ]
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2
    assert _tensorboard_scalars(tmp_path)["sft/loss"] == [(1, 1.0), (2, 2.0), (3, 3.0), (3, 30.0), (4, 40.0)]


def test_read_metrics_missing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        read_metrics(tmp_path)

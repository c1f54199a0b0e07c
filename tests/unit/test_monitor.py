"""DeepSpeed's monitor blocks (``csv_monitor``, ``wandb``, ``comet``, ``tensorboard``) through their own libraries:
files written with DeepSpeed's event names and values, rank 0 only; bad blocks and missing libraries fail in one
line naming the key or the extra."""

from __future__ import annotations

import glob
import importlib.util
import json
import time
import zipfile
from pathlib import Path

import pytest

from hybridzero.config import ConfigError
from hybridzero.monitor import TrainMeter, build_monitor, train_events

EVENTS = [("Train/Samples/lr", 0.015, 4), ("Train/Samples/train_loss", 4.5, 4)]


def test_csv_monitor_writes_one_file_per_event(tmp_path: Path) -> None:
    block = {"csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "job"}}
    monitor = build_monitor(block, 0)
    monitor.write_events(EVENTS)
    monitor.write_events([("Train/Samples/lr", 0.02, 8)])
    monitor.close()
    assert (tmp_path / "job" / "Train_Samples_lr.csv").read_text().splitlines() == ["step,lr", "4,0.015", "8,0.02"]
    assert (tmp_path / "job" / "Train_Samples_train_loss.csv").read_text().splitlines() == ["step,train_loss", "4,4.5"]
    other = build_monitor({"csv_monitor": {"enabled": True, "output_path": str(tmp_path / "r1")}}, 1)
    other.write_events(EVENTS)
    assert not other.enabled and not (tmp_path / "r1").exists()


def test_disabled_or_absent_blocks_do_nothing(tmp_path: Path) -> None:
    assert not build_monitor({}, 0).enabled
    assert not build_monitor({"wandb": {"enabled": False}, "csv_monitor": {"output_path": str(tmp_path)}}, 0).enabled


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"wandb": {"enabled": True, "projekt": "x"}}, r"wandb\.projekt is not a wandb setting; valid keys"),
        ({"csv_monitor": {"enabled": "yes"}}, r"csv_monitor\.enabled must be bool"),
        ({"comet": {"samples_log_interval": 0}}, r"comet\.samples_log_interval must be int >= 1"),
        ({"tensorboard": []}, r"tensorboard must be an object"),
    ],
)
def test_bad_blocks_name_the_key(raw: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build_monitor(raw, 0)


@pytest.mark.parametrize(("block", "module", "extra"), [("wandb", "wandb", "wandb"), ("comet", "comet_ml", "comet")])
def test_missing_library_names_the_extra(monkeypatch, block: str, module: str, extra: str) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))
    with pytest.raises(ConfigError, match=rf"pip install 'hybridzero\[{extra}\]'") as err:
        build_monitor({block: {"enabled": True}}, 1)  # every rank checks, not only the writer
    assert "\n" not in str(err.value)


def test_wandb_offline_run_holds_the_events(monkeypatch, tmp_path: Path) -> None:
    pytest.importorskip("wandb", reason="the wandb extra is installed by scripts/bootstrap.sh")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monitor = build_monitor({"wandb": {"enabled": True, "project": "hz-test", "group": "g"}}, 0)
    monitor.write_events(EVENTS)
    monitor.close()
    (run,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    data = Path(run).read_bytes()
    for _ in range(120):  # wandb's service process may still be writing the file when finish() returns
        if all(name.encode() in data for name, _, _ in EVENTS):
            break
        time.sleep(0.5)
        data = Path(run).read_bytes()
    for name, value, _ in EVENTS:  # history records: key, then the value as JSON text
        at = data.find(name.encode())
        assert at >= 0 and json.dumps(value).encode() in data[at : at + 64], name


def test_comet_offline_experiment_holds_the_events(monkeypatch, tmp_path: Path) -> None:
    pytest.importorskip("comet_ml", reason="the comet extra is installed by scripts/bootstrap.sh")
    monkeypatch.setenv("COMET_OFFLINE_DIRECTORY", str(tmp_path))
    block = {"comet": {"enabled": True, "project": "hz-test", "online": False, "samples_log_interval": 5}}
    monitor = build_monitor(block, 0)
    monitor.write_events(EVENTS)
    monitor.write_events([("Train/Samples/lr", 0.5, 6), ("Train/Samples/lr", 0.02, 9)])  # 6 is < 5 samples after 4
    monitor.close()
    (archive,) = glob.glob(str(tmp_path / "*.zip"))
    lines = zipfile.ZipFile(archive).read("messages.json").decode().splitlines()
    metrics = [json.loads(line)["payload"]["metric"] for line in lines if '"metric"' in line]
    got = {(m["metricName"], float(m["metricValue"]), m["step"]) for m in metrics if "Samples" in m["metricName"]}
    assert got == {(n, v, s) for n, v, s in EVENTS} | {("Train/Samples/lr", 0.02, 9)}


def test_train_events_and_meter(tmp_path: Path) -> None:
    assert train_events(4.0, 0.1, None, 8, 12, 2.0) == [
        ("Train/Samples/train_loss", 4.0, 12),
        ("Train/Samples/lr", 0.1, 12),
        ("Train/Samples/samples_per_sec", 2.0, 12),
    ]
    assert ("Train/Samples/loss_scale", 1024.0, 12) in train_events(None, None, 1024.0, 8, 12, 0.0)
    monitor = build_monitor({"csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "j"}}, 0)
    meter = TrainMeter(monitor)
    meter.observe_loss(3.0)
    meter.observe_loss(5.0)
    meter.step_done(0.25, None, 0, 4)
    assert (tmp_path / "j" / "Train_Samples_train_loss.csv").read_text().splitlines()[1] == "4,4.0"
    assert (tmp_path / "j" / "Train_Samples_lr.csv").read_text().splitlines()[1] == "4,0.25"


def test_tensorboard_writes_event_files(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the tensorboard extra is installed by scripts/bootstrap.sh")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monitor = build_monitor({"tensorboard": {"enabled": True, "output_path": str(tmp_path), "job_name": "tb"}}, 0)
    monitor.write_events(EVENTS)
    monitor.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    for name, value, step in EVENTS:
        (scalar,) = events.Scalars(name)
        assert (scalar.step, scalar.value) == (step, pytest.approx(value))


def test_rlhf_runlog_metrics_go_to_the_monitor(tmp_path: Path) -> None:
    from hybridzero.rlhf.runlog.metrics import RunLog

    block = {"csv_monitor": {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "rl"}}
    with RunLog(tmp_path / "run", 0, tensorboard=False, echo=lambda _: None, monitor=build_monitor(block, 0)) as log:
        log.log(3, {"actor_loss": 1.5, "reward": -0.25}, phase="ppo")
    assert (tmp_path / "csv" / "rl" / "ppo_actor_loss.csv").read_text().splitlines() == ["step,actor_loss", "3,1.5"]
    assert (tmp_path / "csv" / "rl" / "ppo_reward.csv").read_text().splitlines() == ["step,reward", "3,-0.25"]
    assert (tmp_path / "run" / "metrics.jsonl").exists()

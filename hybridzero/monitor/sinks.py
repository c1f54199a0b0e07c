"""The sinks behind :class:`~hybridzero.monitor.Monitor`: TensorBoard, CSV files, Weights & Biases, Comet.

Each sink takes DeepSpeed's events ``(name, value, step)`` (``step`` is the number of samples trained, as DeepSpeed
plots them) and writes them through its own library; none is imported until its block is enabled. Only rank 0
builds sinks (:func:`hybridzero.monitor.build_monitor`).

* TensorBoard: ``torch.utils.tensorboard.SummaryWriter`` on ``output_path/job_name``; one scalar per event.
* CSV: one file per event name, ``output_path/job_name/<name with '/' as '_'>.csv``, header ``step,<last part of
  the name>``, one row per event, appended (a resumed run continues its files) and flushed at once.
* Weights & Biases: ``wandb.init(project, group, entity=team)``; ``wandb.log({name: value}, step=step)`` per step.
  ``WANDB_MODE=offline`` (wandb's own setting) writes the run under ``WANDB_DIR`` without an account.
* Comet: ``comet_ml.start(...)`` with the block's keys; ``log_metric(name, value, step)`` for an event name's
  first event and then whenever its step moved at least ``samples_log_interval`` samples past the last one logged
  (DeepSpeed's schedule). ``COMET_OFFLINE_DIRECTORY`` / ``online: false`` (comet's settings) keep
  the experiment offline.
"""

from __future__ import annotations

import csv
import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

__all__ = ["CometSink", "CsvSink", "Event", "Sink", "TensorBoardSink", "WandbSink"]

Event = tuple[str, float, int]


class Sink(Protocol):
    """Where monitor events go."""

    def write_events(self, events: Sequence[Event]) -> None: ...

    def close(self) -> None: ...


def log_dir(values: dict[str, Any]) -> Path:
    """``output_path/job_name`` of a tensorboard or csv_monitor block (relative paths: the current directory)."""
    return Path(values["output_path"]) / values["job_name"]


class TensorBoardSink:
    """Scalars in TensorBoard event files under ``output_path/job_name``."""

    def __init__(self, values: dict[str, Any]) -> None:
        tb = importlib.import_module("torch.utils.tensorboard")
        self.writer = tb.SummaryWriter(log_dir=str(log_dir(values)))

    def write_events(self, events: Sequence[Event]) -> None:
        for name, value, step in events:
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def csv_file_name(event: str) -> str:
    """File name of one event's CSV (``Train/Samples/lr`` -> ``Train_Samples_lr.csv``)."""
    return event.replace("/", "_") + ".csv"


class CsvSink:
    """One CSV per event name (see the module docstring); no library needed."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.dir = log_dir(values)
        self.dir.mkdir(parents=True, exist_ok=True)

    def write_events(self, events: Sequence[Event]) -> None:
        for name, value, step in events:
            path = self.dir / csv_file_name(name)
            new = not path.exists() or path.stat().st_size == 0
            with path.open("a", newline="", encoding="utf-8") as f:
                out = csv.writer(f)
                if new:
                    out.writerow(["step", name.rsplit("/", 1)[-1]])
                out.writerow([step, repr(float(value))])

    def close(self) -> None:
        return None


class WandbSink:
    """A Weights & Biases run (``project``, ``group``, ``team`` as the entity); one ``log`` call per step."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.wandb = importlib.import_module("wandb")
        self.run = self.wandb.init(project=values["project"], group=values["group"], entity=values["team"])

    def write_events(self, events: Sequence[Event]) -> None:
        by_step: dict[int, dict[str, float]] = {}
        for name, value, step in events:
            by_step.setdefault(int(step), {})[name] = float(value)
        for step in sorted(by_step):
            self.run.log(by_step[step], step=step)

    def close(self) -> None:
        self.run.finish()


class CometSink:
    """A Comet experiment; per event name, the first event and then one every ``samples_log_interval`` samples."""

    def __init__(self, values: dict[str, Any]) -> None:
        comet_ml = importlib.import_module("comet_ml")
        keys = ("api_key", "project", "workspace", "experiment_key", "mode", "online")
        kwargs = {k: values[k] for k in keys if values[k] is not None}
        self.experiment = comet_ml.start(**kwargs)
        if values["experiment_name"] is not None:
            self.experiment.set_name(values["experiment_name"])
        self.interval = int(values["samples_log_interval"])
        self.last: dict[str, int] = {}

    def write_events(self, events: Sequence[Event]) -> None:
        for name, value, step in events:
            if name not in self.last or step - self.last[name] >= self.interval:
                self.last[name] = int(step)
                self.experiment.log_metric(name, float(value), step=int(step))

    def close(self) -> None:
        self.experiment.end()

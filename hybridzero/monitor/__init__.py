"""DeepSpeed's monitors: the ``tensorboard``, ``csv_monitor``, ``wandb`` and ``comet`` config blocks, behind one
small interface (:class:`Monitor`, DeepSpeed's ``MonitorMaster``), written by rank 0 only.

The engine writes DeepSpeed's training events at every optimizer step (:class:`TrainMeter`), against the number of
samples trained (``global_samples``) as DeepSpeed does:

* ``Train/Samples/lr`` (first param group) and ``Train/Samples/loss_scale`` (fp16 only), as DeepSpeed 0.19's
  engine writes them;
* ``Train/Samples/train_loss``: rank 0's mean loss over the step's micro-batches (DeepSpeed documents it and its
  pipeline engine writes it; its plain engine does not);
* ``Train/Samples/samples_per_sec``: ``train_batch_size`` / wall time since the previous step (or since the engine
  was built): DeepSpeed only prints this figure (its ThroughputTimer), so the name is ours.

All at the samples trained after the step (``global_samples``), as DeepSpeed does.

The RLHF steps write their metrics to the same sinks (:mod:`hybridzero.rlhf.runlog.metrics`), named ``<phase>/<metric>``
against their own step count.

Invariants: every rank checks the blocks and that each enabled block's library is importable, so a bad or
unsatisfiable config fails on every rank alike, in one line naming the block and the extra to install
(``pip install 'hybridzero[wandb]'``); only rank 0 imports the libraries and writes.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hybridzero.config.errors import ConfigError
from hybridzero.monitor.config import EXTRAS, MonitorBlock, monitor_blocks
from hybridzero.monitor.sinks import CometSink, CsvSink, Event, Sink, TensorBoardSink, WandbSink

__all__ = ["Event", "Monitor", "MonitorBlock", "Sink", "TrainMeter", "build_monitor", "monitor_blocks", "train_events"]

_SINKS: dict[str, Callable[[dict[str, Any]], Sink]] = {
    "tensorboard": TensorBoardSink,
    "csv_monitor": CsvSink,
    "wandb": WandbSink,
    "comet": CometSink,
}


class Monitor:
    """DeepSpeed's ``MonitorMaster``: fans events out to every sink; ``enabled`` is False when there is none
    (other ranks, or no enabled block)."""

    def __init__(self, sinks: Sequence[Sink] = ()) -> None:
        self.sinks = list(sinks)

    @property
    def enabled(self) -> bool:
        return bool(self.sinks)

    def write_events(self, events: Sequence[Event]) -> None:
        """Write ``(name, value, step)`` events to every sink."""
        for sink in self.sinks:
            sink.write_events(events)

    def close(self) -> None:
        """Close every sink (finish the wandb run, end the comet experiment, flush files); idempotent."""
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close()


def check_libraries(blocks: Sequence[MonitorBlock]) -> None:
    """ConfigError naming the block and the extra when an enabled block's library is not installed."""
    for block in blocks:
        if block.name not in EXTRAS:
            continue
        module, extra = EXTRAS[block.name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"{block.name}.enabled is true but the {module} package is not installed: "
                f"pip install 'hybridzero[{extra}]' (or disable the {block.name} block)",
                key=f"{block.name}.enabled",
                value=True,
            )


def build_monitor(raw: Mapping[str, Any], rank: int) -> Monitor:
    """The monitor of DeepSpeed JSON ``raw``: its enabled blocks' sinks on rank 0, none elsewhere (see the module
    docstring for what every rank checks first)."""
    blocks = monitor_blocks(raw)
    check_libraries(blocks)
    if rank != 0:
        return Monitor()
    return Monitor([_SINKS[b.name](b.values) for b in blocks])


def train_events(
    loss: float | None,
    lr: float | None,
    loss_scale: float | None,
    samples_before: int,
    samples_after: int,
    seconds: float,
) -> list[Event]:
    """DeepSpeed's events of one optimizer step (see the module docstring); ``None`` values are left out, and
    samples/s only when the step took measurable time."""
    events: list[Event] = []
    if loss is not None:
        events.append(("Train/Samples/train_loss", loss, samples_after))
    if lr is not None:
        events.append(("Train/Samples/lr", lr, samples_after))
    if loss_scale is not None:
        events.append(("Train/Samples/loss_scale", loss_scale, samples_after))
    if seconds > 0:
        events.append(("Train/Samples/samples_per_sec", (samples_after - samples_before) / seconds, samples_after))
    return events


class TrainMeter:
    """The engine's side of the monitor: sums rank 0's micro-batch losses of the current step and times steps.
    Does nothing (no ``.item()``, no clock) when the monitor is disabled."""

    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor
        self._loss_sum, self._losses = 0.0, 0
        self._last = time.perf_counter()

    def observe_loss(self, loss: Any) -> None:
        """Record one micro-batch loss (a tensor or number), unscaled."""
        if self.monitor.enabled:
            self._loss_sum += float(loss.detach().float().mean()) if hasattr(loss, "detach") else float(loss)
            self._losses += 1

    def step_done(self, lr: float | None, loss_scale: float | None, samples_before: int, samples_after: int) -> None:
        """Write the step's events and start the next step's window."""
        if not self.monitor.enabled:
            return
        now = time.perf_counter()
        loss = self._loss_sum / self._losses if self._losses else None
        self.monitor.write_events(train_events(loss, lr, loss_scale, samples_before, samples_after, now - self._last))
        self._loss_sum, self._losses, self._last = 0.0, 0, now

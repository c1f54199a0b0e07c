"""Per-run metrics log: one JSON line per logged step (``metrics.jsonl``) plus TensorBoard scalars.

Layout of a run directory::

    run_dir/metrics.jsonl      {"phase": ..., "step": ..., "time": ..., <metric>: <value>, ...} per line
    run_dir/tensorboard/       events.out.tfevents.* with tags "<phase>/<metric>" (torch.utils.tensorboard)

``metrics.jsonl`` is the always-on record. TensorBoard needs the optional ``tensorboard`` package (the
``hybridzero[tensorboard]`` extra); without it the events are skipped with one warning and training goes on.
The same metrics also go to the engine's config monitors (``wandb``, ``csv_monitor``, ``comet``, ``tensorboard``
blocks: :mod:`hybridzero.monitor`) as ``<phase>/<metric>`` at the step, when the step passes its engine's monitor.

Non-finite metric values are written as the strings ``"nan"``, ``"inf"`` and ``"-inf"`` so every line is
strict JSON; :func:`read_metrics` turns them back into floats.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import IO, TYPE_CHECKING, Any

from tqdm import tqdm

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter
    from typing_extensions import Self

    from hybridzero.monitor import Monitor

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
RESERVED_KEYS: frozenset[str] = frozenset({"phase", "step", "time"})
_NON_FINITE: Mapping[str, float] = MappingProxyType({"nan": math.nan, "inf": math.inf, "-inf": -math.inf})


def _json_number(value: float) -> float | str:
    """``value`` as JSON-safe: finite floats unchanged, NaN / +-inf as ``"nan"`` / ``"inf"`` / ``"-inf"``."""
    if math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def metrics_record(step: int, metrics: Mapping[str, float], phase: str, wall_time: float) -> dict[str, Any]:
    """The JSON object of one line; values go through ``float()`` (0-dim tensors and ints are fine).

    Raises ``ValueError`` when a metric is named like a reserved key (``phase``, ``step``, ``time``).
    """
    clash = RESERVED_KEYS.intersection(metrics)
    if clash:
        raise ValueError(f"metric names {sorted(clash)} are reserved in {METRICS_FILE}")
    record: dict[str, Any] = {"phase": phase, "step": int(step), "time": wall_time}
    record.update({str(key): _json_number(float(value)) for key, value in metrics.items()})
    return record


def open_summary_writer(log_dir: Path) -> SummaryWriter | None:
    """A ``SummaryWriter`` on ``log_dir``, or ``None`` (one warning) when the ``tensorboard`` package is missing."""
    try:  # optional dependency: importing torch.utils.tensorboard fails without the tensorboard package
        from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 - optional extra
    except ImportError:
        warnings.warn(
            "TensorBoard output skipped: the tensorboard package is not installed "
            "(pip install 'hybridzero[tensorboard]'); metrics.jsonl has every metric",
            stacklevel=3,
        )
        return None
    return SummaryWriter(log_dir=str(log_dir))


def _ends_with_newline(path: Path) -> bool:
    """True for a missing or empty file or one whose last byte is a newline."""
    if not path.exists() or path.stat().st_size == 0:
        return True
    with path.open("rb") as handle:
        handle.seek(-1, 2)
        return handle.read(1) == b"\n"


class RunLog:
    """Metrics sink shared by all ranks: only rank 0 with a ``run_dir`` writes and echoes; others are no-ops.

    ``metrics.jsonl`` is opened in append mode (a resumed run continues the same file) and flushed after
    every line; TensorBoard events go to a new file under ``run_dir/tensorboard/`` each time a RunLog opens
    (skipped, with one warning, when the ``tensorboard`` package is not installed).
    """

    def __init__(
        self,
        run_dir: Path | str | None,
        rank: int,
        *,
        tensorboard: bool = True,
        echo: Callable[[str], None] = print,
        monitor: Monitor | None = None,
    ) -> None:
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.rank = rank
        self._echo = echo
        self.monitor = monitor  # the engine's config monitors (wandb, csv_monitor, comet, tensorboard): not closed here
        self.active = rank == 0 and self.run_dir is not None
        self._file: IO[str] | None = None
        self._events: SummaryWriter | None = None
        if self.active and self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            path = self.run_dir / METRICS_FILE
            needs_newline = not _ends_with_newline(path)
            self._file = path.open("a", encoding="utf-8")
            if needs_newline:  # a crash mid-line left a fragment: keep it on its own (skipped) line
                self._file.write("\n")
            if tensorboard:
                self._events = open_summary_writer(self.run_dir / TENSORBOARD_DIR)

    @property
    def metrics_path(self) -> Path | None:
        """``run_dir/metrics.jsonl`` (``None`` without a run directory)."""
        return self.run_dir / METRICS_FILE if self.run_dir is not None else None

    def log(self, step: int, metrics: Mapping[str, float], phase: str) -> None:
        """Append one line for ``(phase, step)`` and the same scalars as TensorBoard tags ``phase/key``."""
        if self.monitor is not None and self.active:
            self.monitor.write_events([(f"{phase}/{key}", float(value), int(step)) for key, value in metrics.items()])
        if self._file is None:
            return
        now = time.time()
        record = metrics_record(step, metrics, phase, now)
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        if self._events is not None:
            for key, value in metrics.items():
                self._events.add_scalar(f"{phase}/{key}", float(value), global_step=int(step), walltime=now)
            self._events.flush()

    def print(self, line: str) -> None:
        """Echo ``line`` on rank 0 (whether or not there is a run directory)."""
        if self.rank == 0:
            self._echo(line)

    def close(self) -> None:
        """Flush and close both files; idempotent."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._events is not None:
            self._events.close()
            self._events = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _decode_values(record: dict[str, Any]) -> dict[str, Any]:
    """Turn the ``"nan"`` / ``"inf"`` / ``"-inf"`` strings of metric values back into floats."""
    return {
        key: _NON_FINITE[value]
        if key not in RESERVED_KEYS and isinstance(value, str) and value in _NON_FINITE
        else value
        for key, value in record.items()
    }


def read_metrics(run_dir: Path | str) -> list[dict[str, Any]]:
    """The records of ``run_dir/metrics.jsonl``, one per ``(phase, step)``, in order of last write.

    Lines with the same ``(phase, step)`` (a resumed run re-logging steps after its checkpoint, or a train and
    an eval line of one step) are merged key by key, later values winning, and the merged record takes the
    position of its last line. Lines that are not JSON objects with ``phase`` and ``step`` (a fragment left
    by a crash) are skipped with a warning. Raises ``FileNotFoundError`` naming the directory when the file
    is missing.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {METRICS_FILE} in run directory {Path(run_dir)}")
    merged: dict[tuple[str, int], dict[str, Any]] = {}
    skipped = 0
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if (
            not isinstance(record, dict)
            or not isinstance(record.get("phase"), str)
            or not isinstance(record.get("step"), int)
        ):
            skipped += 1
            continue
        key = (record["phase"], int(record["step"]))
        previous = merged.pop(key, {})
        merged[key] = {**previous, **_decode_values(record)}
    if skipped:
        warnings.warn(f"{path}: skipped {skipped} malformed line(s)", stacklevel=2)
    return list(merged.values())


def echo_fn(progress: bool) -> Callable[[str], None]:
    """``tqdm.write`` when a progress bar is live (keeps the bar at the bottom), else ``print``."""
    if progress:
        return lambda line: tqdm.write(line)
    return lambda line: print(line, flush=True)


def open_runlog(
    output_dir: str, rank: int, tensorboard: bool, progress: bool, monitor: Monitor | None = None
) -> RunLog:
    """The step's :class:`RunLog` in ``output_dir`` (rank 0 writes, others no-op); its metrics also go to
    ``monitor`` (an engine's config monitors, :mod:`hybridzero.monitor`) as ``<phase>/<metric>`` at the step."""
    return RunLog(Path(output_dir), rank, tensorboard=tensorboard, echo=echo_fn(progress), monitor=monitor)

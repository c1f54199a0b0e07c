"""Training curves of a run directory as matplotlib PNGs (``hybridzero plot RUN_DIR``, the demo's plots).

Reads ``run_dir/metrics.jsonl`` (see :mod:`hybridzero.rlhf.runlog.metrics`) and draws, per phase, one figure per concept
(reward, KL, losses, throughput, ...). A figure has one **panel per quantity**: only series with the same unit
share a y axis (the reward model's score and a 0-1 rate never do). Every metric not in a known panel gets a figure
of its own. A phase ``P_eval`` is drawn on ``P``'s figures (keys prefixed ``eval_``), as markers.

Dense training series are drawn twice: the raw values faint, a smoothed line (debiased exponential moving
average, TensorBoard's) solid on top. matplotlib is the optional ``plots`` extra: training never imports this
module's drawing code, and asking for plots without it raises :class:`PlotsUnavailable` with the install line.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from hybridzero.rlhf.runlog.metrics import METRICS_FILE, RESERVED_KEYS, read_metrics

__all__ = ["ChartSpec", "Panel", "PlotsUnavailable", "ema_smooth", "fold_eval_phases", "plan_charts", "plot_run"]


@dataclass(frozen=True)
class Panel:
    """One y axis: ``keys`` are series of the same quantity in ``unit``. Invariant: ``keys`` is non-empty."""

    title: str
    unit: str
    keys: tuple[str, ...]


@dataclass(frozen=True)
class ChartSpec:
    """One PNG: the panels of ``phase``'s figure ``name``, stacked, sharing the step axis."""

    phase: str
    name: str
    panels: tuple[Panel, ...]

    @property
    def keys(self) -> tuple[str, ...]:
        """Every series of the figure, panel by panel."""
        return tuple(key for panel in self.panels for key in panel.keys)

    @property
    def file_name(self) -> str:
        """``{phase}_{name}.png`` with anything but letters, digits, ``.``, ``-`` and ``_`` replaced by ``_``."""
        return re.sub(r"[^A-Za-z0-9._-]", "_", f"{self.phase}_{self.name}") + ".png"


class PlotsUnavailable(RuntimeError):
    """matplotlib (the ``plots`` extra) is not installed."""


Figure = tuple[str, tuple[Panel, ...]]  # (figure name, panels)

_FRACTION = "fraction (0-1)"
_LOSS: Figure = (
    "loss",
    (Panel("language-model loss (training and held-out)", "nats per token", ("loss", "train_loss", "eval_loss")),),
)
_PHASE_FIGURES: Mapping[str, tuple[Figure, ...]] = MappingProxyType(
    {
        "ppo": (
            (
                "reward",
                (
                    Panel("reward model score", "score", ("reward", "ema_reward")),
                    Panel("hidden rule (never seen in training)", _FRACTION, ("rule_score", "copy_rate")),
                ),
            ),
            ("kl", (Panel("KL to the reference policy", "nats per token", ("kl",)),)),
            (
                "losses",
                (
                    Panel("actor (policy) loss", "loss", ("actor_loss",)),
                    Panel("critic (value) loss", "loss", ("critic_loss",)),
                    Panel("unsupervised (ptx) loss", "nats per token", ("ptx_loss",)),
                ),
            ),
            (
                "policy_update",
                (
                    Panel("policy drift per update (approximate KL)", "nats per token", ("approx_kl",)),
                    Panel("tokens whose ratio was clipped", _FRACTION, ("clip_fraction",)),
                ),
            ),
        ),
        "sft": (
            _LOSS,
            (
                "perplexity",
                (
                    Panel(
                        "perplexity",
                        "perplexity",
                        ("perplexity", "train_perplexity", "eval_perplexity", "ppl", "eval_ppl"),
                    ),
                ),
            ),
        ),
        "reward": (
            (
                "loss",
                (Panel("pairwise loss  -log sigmoid(chosen - rejected)", "loss", ("loss", "train_loss", "eval_loss")),),
            ),
            (
                "accuracy",
                (
                    Panel(
                        "pairs ranked correctly",
                        _FRACTION,
                        ("accuracy", "acc", "train_accuracy", "eval_accuracy", "eval_acc"),
                    ),
                ),
            ),
            (
                "scores",
                (
                    Panel(
                        "reward-model score of the chosen and the rejected answer",
                        "score",
                        ("chosen_score", "rejected_score", "eval_chosen_score", "eval_rejected_score"),
                    ),
                ),
            ),
        ),
    }
)
_PHASE_ALIASES: Mapping[str, str] = MappingProxyType({"grpo": "ppo", "rm": "reward"})
# Throughput keys (hybridzero.rlhf.runlog.report) are grouped in every phase.
_COMMON_FIGURES: tuple[Figure, ...] = (
    ("throughput", (Panel("throughput", "samples per second", ("samples_per_s",)),)),
    ("tflops", (Panel("achieved compute", "TFLOP/s", ("e2e_tflops", "gen_tflops", "train_tflops")),)),
    (
        "latency",
        (
            Panel(
                "time per step",
                "seconds",
                (
                    "e2e_latency_s",
                    "gen_latency_s",
                    "train_latency_s",
                    "e2e_s",
                    "generation_s",
                    "training_s",
                    "step_time_s",
                ),
            ),
        ),
    ),
    ("lr", (Panel("learning rate (schedule)", "learning rate", ("lr", "actor_lr")),)),
)
# Report-line constants of the throughput dict (no curve to see) and timing keys that duplicate a
# ``*_latency_s`` key when both are logged.
_NOT_PLOTTED: frozenset[str] = frozenset(
    {"global_batch_size", "total_seq_len", "answer_seq_len", "actor_params_b", "critic_params_b"}
)
_TWINS: Mapping[str, str] = MappingProxyType(
    {"e2e_s": "e2e_latency_s", "generation_s": "gen_latency_s", "training_s": "train_latency_s"}
)
EVAL_SUFFIX = "_eval"
_SMOOTH_MIN_POINTS = 12  # fewer points: the raw line alone, with markers


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def phase_figures(phase: str) -> tuple[Figure, ...]:
    """The known figures of ``phase`` (``grpo`` shares ``ppo``'s, ``rm`` shares ``reward``'s)."""
    return _PHASE_FIGURES.get(_PHASE_ALIASES.get(phase, phase), ()) + _COMMON_FIGURES


def fold_eval_phases(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Records of a phase ``P_eval`` re-labelled as phase ``P``, their keys prefixed ``eval_`` (once).

    So ``sft_eval``'s ``eval_loss`` / ``perplexity`` land on the ``sft`` charts as ``eval_loss`` /
    ``eval_perplexity`` next to the training curves. Other records are copied unchanged.
    """
    out = []
    for record in records:
        phase = str(record["phase"])
        if not phase.endswith(EVAL_SUFFIX) or phase == EVAL_SUFFIX:
            out.append(dict(record))
            continue
        folded: dict[str, Any] = {"phase": phase[: -len(EVAL_SUFFIX)]}
        for key, value in record.items():
            if key in RESERVED_KEYS:
                folded.setdefault(key, value)
            else:
                folded[key if key.startswith("eval_") else f"eval_{key}"] = value
        out.append(folded)
    return out


def _present_keys(records: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, None]]:
    """Per phase (first-appearance order), the plotted keys with at least one numeric value."""
    present: dict[str, dict[str, None]] = {}
    for record in records:
        keys = present.setdefault(str(record["phase"]), {})
        for key, value in record.items():
            if key not in RESERVED_KEYS and key not in _NOT_PLOTTED and _is_number(value):
                keys.setdefault(key, None)
    for keys in present.values():
        for twin, kept in _TWINS.items():
            if kept in keys:
                keys.pop(twin, None)
    return present


def plan_charts(records: Sequence[Mapping[str, Any]]) -> list[ChartSpec]:
    """The figures for ``records``: known figures with their panels restricted to the present keys (empty panels
    dropped), then one single-panel figure per leftover key. Phases and leftover keys keep their order of first
    appearance. The throughput report's constants are not plotted, nor ``e2e_s`` / ``generation_s`` /
    ``training_s`` when their ``*_latency_s`` twins are logged too."""
    charts = []
    for phase, keys in _present_keys(records).items():
        grouped: set[str] = set()
        for name, panels in phase_figures(phase):
            shown = tuple(Panel(p.title, p.unit, tuple(k for k in p.keys if k in keys)) for p in panels)
            shown = tuple(p for p in shown if p.keys)
            if shown:
                charts.append(ChartSpec(phase, name, shown))
                grouped.update(k for p in shown for k in p.keys)
        charts.extend(ChartSpec(phase, key, (Panel(key, key, (key,)),)) for key in keys if key not in grouped)
    return charts


def chart_series(records: Sequence[Mapping[str, Any]], spec: ChartSpec) -> dict[str, list[tuple[float, float]]]:
    """``key -> [(step, value), ...]`` sorted by step for the records of ``spec.phase`` (non-finite values kept)."""
    rows = sorted((r for r in records if r["phase"] == spec.phase), key=lambda r: int(r["step"]))
    return {
        key: [(float(r["step"]), float(r[key])) for r in rows if key in r and _is_number(r[key])] for key in spec.keys
    }


def ema_smooth(values: Sequence[float], weight: float) -> list[float]:
    """Debiased exponential moving average (TensorBoard's smoothing); non-finite values are passed through and
    do not enter the average. ``weight`` in ``[0, 1)``: 0 returns the values unchanged."""
    out, avg, norm = [], 0.0, 0.0
    for value in values:
        if not math.isfinite(value):
            out.append(value)
            continue
        avg, norm = weight * avg + (1.0 - weight) * value, weight * norm + (1.0 - weight)
        out.append(avg / norm)
    return out


def smoothing_weight(n_points: int) -> float:
    """EMA weight ``1 - 2 / (w + 1)`` of a window ``w`` of a twelfth of the run (at least 3 points); 0 (no
    smoothing) for runs shorter than ``_SMOOTH_MIN_POINTS``."""
    if n_points < _SMOOTH_MIN_POINTS:
        return 0.0
    window = max(n_points / 12.0, 3.0)
    return 1.0 - 2.0 / (window + 1.0)


_LEGEND: Mapping[str, str] = MappingProxyType(
    {
        "e2e_latency_s": "end to end",
        "gen_latency_s": "generation",
        "train_latency_s": "training",
        "e2e_s": "end to end",
        "generation_s": "generation",
        "training_s": "training",
        "step_time_s": "optimizer step",
        "e2e_tflops": "end to end",
        "gen_tflops": "generation",
        "train_tflops": "training",
        "lr": "learning rate",
        "actor_lr": "actor learning rate",
        "samples_per_s": "samples/s",
        "ema_reward": "EMA actor's reward",
    }
)


def _label(key: str) -> str:
    """Legend text: a readable name; ``eval_x`` is "x (held-out)"."""
    if key in _LEGEND:
        return _LEGEND[key]
    if key.startswith("eval_"):
        return f"{key.removeprefix('eval_').replace('_', ' ')} (held-out)"
    return key.replace("_", " ")


def _draw_panel(ax: Any, panel: Panel, series: Mapping[str, list[tuple[float, float]]]) -> None:
    """One quantity: per key a faint raw line and a smoothed solid one (or markers for sparse eval points)."""
    for i, key in enumerate(panel.keys):
        points = series.get(key, [])
        if not points:
            continue
        color = f"C{i}"
        steps, values = [p[0] for p in points], [p[1] for p in points]
        weight = smoothing_weight(len(points))
        if key.startswith("eval_") or weight == 0.0:
            ax.plot(steps, values, color=color, marker="o", markersize=4, linewidth=1.5, label=_label(key))
            continue
        ax.plot(steps, values, color=color, alpha=0.25, linewidth=1.0)
        ax.plot(steps, ema_smooth(values, weight), color=color, linewidth=2.0, label=f"{_label(key)} (smoothed)")
    ax.set_title(panel.title, fontsize=11, loc="left")
    ax.set_ylabel(panel.unit)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=9, frameon=False)


def _write_figure(path: Path, spec: ChartSpec, series: Mapping[str, list[tuple[float, float]]]) -> Path:
    """Render ``spec`` (Agg canvas, no pyplot global state) to ``path``."""
    try:  # optional dependency (the `plots` extra): only plotting needs it
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415 - optional extra
        from matplotlib.figure import Figure as MplFigure  # noqa: PLC0415 - optional extra
    except ImportError:
        raise PlotsUnavailable("plotting needs matplotlib: pip install 'hybridzero[plots]'") from None
    n = len(spec.panels)
    fig = MplFigure(figsize=(8.0, 1.0 + 2.6 * n), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(n, 1, sharex=True, squeeze=False)[:, 0]
    for ax, panel in zip(axes, spec.panels):
        _draw_panel(ax, panel, series)
    axes[-1].set_xlabel("step" if spec.phase not in ("ppo", "grpo") else f"{spec.phase.upper()} iteration")
    fig.suptitle(f"{spec.phase}: {spec.name}", fontsize=13, fontweight="bold")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def plot_run(run_dir: Path | str, out_dir: Path | str | None = None) -> list[Path]:
    """Write the PNG figures of ``run_dir`` to ``out_dir`` (default ``run_dir/plots``); return their paths.

    Raises ``FileNotFoundError`` naming ``run_dir`` when it has no ``metrics.jsonl`` and :class:`PlotsUnavailable`
    without matplotlib. Existing PNGs of the same names are overwritten; a file without records yields no figure.
    """
    run_dir = Path(run_dir)
    if not (run_dir / METRICS_FILE).is_file():
        raise FileNotFoundError(
            f"no {METRICS_FILE} in {run_dir}: is it a run directory written by a hybridzero trainer?"
        )
    records = fold_eval_phases(read_metrics(run_dir))
    target = Path(out_dir) if out_dir is not None else run_dir / "plots"
    return [_write_figure(target / spec.file_name, spec, chart_series(records, spec)) for spec in plan_charts(records)]

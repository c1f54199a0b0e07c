"""PNG charts of a ``bench/bench_peers.py`` run, drawn with matplotlib (the ``plots`` extra).

Per (world size, dtype) two charts, one line per system:

* ``peers_loss_w<W>_<dtype>.png``: the loss curve of round 1 (mean over ranks; every step, warm-up included);
* ``peers_step_ms_w<W>_<dtype>.png``: step time (slowest rank) of every measured step, the rounds back to back
  (x = 1 … rounds × steps), so drift within and between rounds stays visible.

:func:`write_plots` returns one record per chart (kind, world size, dtype and the file name relative to the output
directory) for ``peers.json``; :func:`plots_markdown` embeds them in ``peers.md``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

Runs = Mapping[tuple[int, str, str], Sequence[Mapping[str, Any]]]
"""Per (world, dtype, system): one summary per round (``losses``, ``step_times_ms``), as ``bench_peers`` builds."""


def loss_series(runs: Runs, world: int, dtype: str, systems: Sequence[str]) -> dict[str, list[tuple[float, float]]]:
    """Round 1's loss per step (1-based x) of every system that ran at (``world``, ``dtype``)."""
    series = {}
    for system in systems:
        reps = runs.get((world, dtype, system))
        if reps:
            series[system] = [(float(i + 1), float(loss)) for i, loss in enumerate(reps[0]["losses"])]
    return series


def step_time_series(
    runs: Runs, world: int, dtype: str, systems: Sequence[str]
) -> dict[str, list[tuple[float, float]]]:
    """Every measured step's time in ms of every system, rounds concatenated in order (1-based x)."""
    series = {}
    for system in systems:
        reps = runs.get((world, dtype, system))
        if reps:
            times = [t for rep in reps for t in rep["step_times_ms"]]
            series[system] = [(float(i + 1), float(t)) for i, t in enumerate(times)]
    return series


def line_chart(
    path: Path, series: Mapping[str, Sequence[tuple[float, float]]], title: str, xlabel: str, ylabel: str
) -> Path:
    """One line per series (Agg canvas, no pyplot global state), written to ``path``."""
    # optional dependency (the `plots` extra), needed only when charts are written
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.0, 4.0), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for name, points in series.items():
        ax.plot([p[0] for p in points], [p[1] for p in points], linewidth=1.5, label=name)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", frameon=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def write_plots(runs: Runs, systems: Sequence[str], out: Path, label: str = "") -> list[dict[str, Any]]:
    """Write both charts for every (world, dtype) in ``runs`` under ``out``; one record per chart written.

    ``label`` (for instance the model name) is appended to each chart's title.
    """
    suffix = f" [{label}]" if label else ""
    records = []
    for world, dtype in sorted({(w, d) for (w, d, _) in runs}):
        charts = (
            (
                "loss",
                loss_series(runs, world, dtype, systems),
                f"training loss, W={world} {dtype}{suffix}",
                "step (warm-up included, round 1)",
                "loss (mean over ranks)",
            ),
            (
                "step_ms",
                step_time_series(runs, world, dtype, systems),
                f"step time, W={world} {dtype}{suffix}",
                "measured step (rounds back to back)",
                "ms per step (slowest rank)",
            ),
        )
        for kind, series, title, xlabel, ylabel in charts:
            name = f"peers_{kind}_w{world}_{dtype}.png"
            line_chart(out / name, series, title, xlabel, ylabel)
            records.append({"kind": kind, "world_size": world, "dtype": dtype, "path": name})
    return records


def plots_markdown(records: Sequence[Mapping[str, Any]]) -> str:
    """Markdown image links for the chart ``records`` (paths relative to the Markdown file)."""
    lines = [f"![{r['kind']} W={r['world_size']} {r['dtype']}]({r['path']})" for r in records]
    return "\n".join(lines)

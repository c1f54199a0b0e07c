"""Training curves of a run directory as PNG files (``hybridzero plot RUN_DIR``).

Reads ``run_dir/metrics.jsonl`` (see :mod:`hybridzero.rlhf.runlog`) and draws, per phase, one chart per group
of related metrics against the step; every metric not in a known group gets a chart of its own. A phase
``P_eval`` is drawn on ``P``'s charts (keys prefixed ``eval_``).
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from hybridzero.rlhf.runlog import METRICS_FILE, RESERVED_KEYS, read_metrics
from hybridzero.viz.png import line_chart

Group = tuple[str, tuple[str, ...]]  # (chart name, metric keys in legend order)

_LOSS: Group = ("loss", ("loss", "train_loss", "eval_loss"))
_PHASE_GROUPS: Mapping[str, tuple[Group, ...]] = MappingProxyType({
    "ppo": (
        ("reward", ("reward", "ema_reward", "rule_score")),
        ("kl", ("kl",)),
        ("losses", ("actor_loss", "critic_loss", "ptx_loss")),
    ),
    "sft": (_LOSS, ("perplexity", ("perplexity", "train_perplexity", "eval_perplexity", "ppl", "eval_ppl"))),
    "reward": (_LOSS, ("accuracy", ("accuracy", "acc", "train_accuracy", "eval_accuracy", "eval_acc"))),
})
_PHASE_ALIASES: Mapping[str, str] = MappingProxyType({"grpo": "ppo", "rm": "reward"})
# Throughput keys (hybridzero.rlhf.throughput) are grouped in every phase.
_COMMON_GROUPS: tuple[Group, ...] = (
    ("throughput", ("samples_per_s",)),
    ("tflops", ("e2e_tflops", "gen_tflops", "train_tflops")),
    ("latency", ("e2e_latency_s", "gen_latency_s", "train_latency_s", "e2e_s", "generation_s", "training_s")),
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


@dataclass(frozen=True)
class ChartSpec:
    """One chart to draw: metrics ``keys`` of ``phase`` on one set of axes. Invariant: ``keys`` is non-empty."""

    phase: str
    name: str
    keys: tuple[str, ...]

    @property
    def file_name(self) -> str:
        """``{phase}_{name}.png`` with anything but letters, digits, ``.``, ``-`` and ``_`` replaced by ``_``."""
        return re.sub(r"[^A-Za-z0-9._-]", "_", f"{self.phase}_{self.name}") + ".png"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def phase_groups(phase: str) -> tuple[Group, ...]:
    """The known metric groups of ``phase`` (``grpo`` shares ``ppo``'s, ``rm`` shares ``reward``'s)."""
    return _PHASE_GROUPS.get(_PHASE_ALIASES.get(phase, phase), ()) + _COMMON_GROUPS


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


def plan_charts(records: Sequence[Mapping[str, Any]]) -> list[ChartSpec]:
    """The charts for ``records``: known groups restricted to the present keys, then one per leftover key.

    A key is present in a phase when at least one record of that phase has a numeric value for it. Phases and
    leftover keys keep their order of first appearance. The throughput report's constants (batch size,
    lengths, parameter counts) are not plotted, nor ``e2e_s`` / ``generation_s`` / ``training_s`` when their
    ``*_latency_s`` twins are logged too.
    """
    present: dict[str, dict[str, None]] = {}
    for record in records:
        keys = present.setdefault(str(record["phase"]), {})
        for key, value in record.items():
            if key not in RESERVED_KEYS and key not in _NOT_PLOTTED and _is_number(value):
                keys.setdefault(key, None)
    charts = []
    for phase, keys in present.items():
        for twin, kept in _TWINS.items():
            if kept in keys:
                keys.pop(twin, None)
        grouped: set[str] = set()
        for name, members in phase_groups(phase):
            shown = tuple(key for key in members if key in keys)
            if shown:
                charts.append(ChartSpec(phase, name, shown))
                grouped.update(shown)
        charts.extend(ChartSpec(phase, key, (key,)) for key in keys if key not in grouped)
    return charts


def chart_series(records: Sequence[Mapping[str, Any]], spec: ChartSpec) -> dict[str, list[tuple[float, float]]]:
    """``key -> [(step, value), ...]`` sorted by step for the records of ``spec.phase``."""
    rows = sorted((r for r in records if r["phase"] == spec.phase), key=lambda r: int(r["step"]))
    return {
        key: [(float(r["step"]), float(r[key])) for r in rows if key in r and _is_number(r[key])]
        for key in spec.keys
    }


def plot_run(run_dir: Path | str, out_dir: Path | str | None = None) -> list[Path]:
    """Write the PNG curves of ``run_dir`` to ``out_dir`` (default ``run_dir/plots``); return their paths.

    Raises ``FileNotFoundError`` naming ``run_dir`` when it has no ``metrics.jsonl``. Existing PNGs of the
    same names are overwritten; a file without records yields no chart.
    """
    run_dir = Path(run_dir)
    if not (run_dir / METRICS_FILE).is_file():
        raise FileNotFoundError(
            f"no {METRICS_FILE} in {run_dir}: is it a run directory written by a hybridzero trainer?"
        )
    records = fold_eval_phases(read_metrics(run_dir))
    target = Path(out_dir) if out_dir is not None else run_dir / "plots"
    paths = []
    for spec in plan_charts(records):
        series = chart_series(records, spec)
        ylabel = spec.name if len(spec.keys) > 1 else spec.keys[0]
        paths.append(line_chart(target / spec.file_name, series, f"{spec.phase}: {spec.name}", "step", ylabel))
    return paths

"""The accounting of ``bench/bench_profile.py``: per-rank step parts, their check against the step time, the table
and the stacked bar chart. Torch-free and pure but for the chart (matplotlib, the ``plots`` extra).

A worker records, per measured step and rank, the step's wall time (``wall_ms``, one ``perf_counter`` pair around
forward + backward + step) and the exclusive milliseconds of every profile region (``regions``, from
:class:`hybridzero.comm.timing.StepTimer`). Regions are folded into the parts of :data:`PARTS`:

* ``compute``: forward/backward math (``compute.forward`` / ``compute.backward`` outside every nested region);
* ``optimizer``: clipping's norm and the optimizer's math (``compute.optimizer``);
* ``comm``: this thread's time inside collectives (issuing them; the rank-ordered sum of the reduction; the local
  copies of world 1), per collective kind in the JSON;
* ``copies``: flat-buffer packing, casts, gradient copies, unpacking of coalesced gathers, zeroing;
* ``hooks``: hook bodies and the engine step's bookkeeping (``hooks``, ``hooks.step``);
* ``idle``: blocked in a wait for a collective that had not completed (peers, or the transport, still busy).

The check: ``|wall - sum(parts)| <= tolerance * wall`` for every rank and step (the parts are exclusive, so this
holds unless time is spent outside the measured regions).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from statistics import median
from typing import Any

PARTS: tuple[str, ...] = ("compute", "optimizer", "comm", "copies", "hooks", "idle")
"""The parts of a step, in table and chart order."""
LABELS: dict[str, str] = {
    "compute": "fwd+bwd math",
    "optimizer": "optimizer math",
    "comm": "communication (this thread)",
    "copies": "copies",
    "hooks": "hooks / bookkeeping",
    "idle": "idle / waiting",
}
_KIND_TO_PART = {"comm": "comm", "copy": "copies", "hooks": "hooks", "wait": "idle"}


def part_of(region: str) -> str:
    """The part (:data:`PARTS`) a region name is charged to; ValueError for a name of no known kind."""
    if region == "compute.optimizer":
        return "optimizer"
    kind = region.split(".", 1)[0]
    if kind == "compute":
        return "compute"
    if kind in _KIND_TO_PART:
        return _KIND_TO_PART[kind]
    raise ValueError(f"profile region {region!r} has no known kind: expected compute, comm, copy, hooks or wait")


def step_parts(regions: Mapping[str, float]) -> dict[str, float]:
    """One rank-step's region totals folded into :data:`PARTS` (same unit as the input)."""
    out = dict.fromkeys(PARTS, 0.0)
    for name, value in regions.items():
        out[part_of(name)] += value
    return out


def comm_by_collective(regions: Mapping[str, float]) -> dict[str, float]:
    """Communication and waiting per collective kind (``all_gather``, ``reduce_scatter``, ...)."""
    out: dict[str, float] = {}
    for name, value in regions.items():
        kind, _, rest = name.partition(".")
        if kind in ("comm", "wait") and rest:
            collective = rest.split(".", 1)[0]
            out[collective] = out.get(collective, 0.0) + value
    return out


def accounting_error(regions: Mapping[str, float], wall: float) -> float:
    """``(wall - sum of parts) / wall``: the share of the step that no region accounts for (negative if the parts
    exceed the wall time, which exclusive regions cannot do)."""
    if wall <= 0:
        raise ValueError(f"a step's wall time must be positive, got {wall}")
    return (wall - sum(regions.values())) / wall


def check_accounting(ranks: Sequence[Mapping[str, Any]], tolerance: float) -> list[str]:
    """Every rank-step whose parts miss its wall time by more than ``tolerance`` (a fraction), as messages."""
    bad = []
    for rank in ranks:
        for i, step in enumerate(rank["steps"]):
            err = accounting_error(step["regions"], step["wall_ms"])
            if abs(err) > tolerance:
                bad.append(
                    f"rank {rank['rank']} of world {rank['world_size']}, step {i}: parts sum to "
                    f"{sum(step['regions'].values()):.2f} ms of {step['wall_ms']:.2f} ms ({err:+.1%})"
                )
    return bad


def summarize(label: str, dtype: str, ranks: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One table row from the per-rank records of one run: the median step (slowest rank per step) and the mean
    parts per rank-step, in ms."""
    n_steps = len(ranks[0]["steps"])
    walls = [max(r["steps"][s]["wall_ms"] for r in ranks) for s in range(n_steps)]
    records = [step for r in ranks for step in r["steps"]]
    parts = [step_parts(step["regions"]) for step in records]
    mean_parts = {p: sum(x[p] for x in parts) / len(parts) for p in PARTS}
    per_collective: dict[str, float] = {}
    for step in records:
        for name, value in comm_by_collective(step["regions"]).items():
            per_collective[name] = per_collective.get(name, 0.0) + value / len(records)
    mean_wall = sum(step["wall_ms"] for step in records) / len(records)
    cpu = [(s.get("process_cpu_ms", 0.0), s.get("thread_cpu_ms", 0.0)) for s in records]
    return {
        "system": label,
        "dtype": dtype,
        "world_size": 0 if ranks[0]["world_size"] == 0 else len(ranks),  # 0: the floor
        "median_step_ms": median(walls),
        "mean_rank_step_ms": mean_wall,
        "parts_ms": mean_parts,
        "unaccounted_ms": mean_wall - sum(mean_parts.values()),
        "comm_and_wait_by_collective_ms": per_collective,
        "process_cpu_ms": sum(c[0] for c in cpu) / len(cpu),  # all threads of a rank, per step
        "other_threads_cpu_ms": sum(c[0] - c[1] for c in cpu) / len(cpu),  # the transport's threads (gloo)
        "per_rank_parts_ms": [
            {p: sum(step_parts(s["regions"])[p] for s in r["steps"]) / n_steps for p in PARTS} for r in ranks
        ],
        "step_walls_ms": walls,
    }


def add_floor_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's median step and compute over the floor row of its dtype (the row with world size 0)."""
    floors = {r["dtype"]: r for r in rows if r["world_size"] == 0}
    for row in rows:
        floor = floors.get(row["dtype"])
        if floor is None:
            continue
        row["step_vs_floor"] = row["median_step_ms"] / floor["median_step_ms"]
        row["compute_excess_ms"] = (row["parts_ms"]["compute"] + row["parts_ms"]["optimizer"]) - (
            floor["parts_ms"]["compute"] + floor["parts_ms"]["optimizer"]
        )


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The profile as a Markdown table (ms per rank-step; the floor is W = 0 in the JSON, "floor" here)."""
    head = " | ".join(LABELS[p] for p in PARTS)
    lines = [
        f"| run | dtype | step ms (median) | ×floor | {head} | unaccounted | compute over floor "
        "| CPU ms/rank-step: all threads (other threads) |",
        "|---|---|---:|---:|" + "---:|" * len(PARTS) + "---:|---:|---:|",
    ]
    for r in rows:
        cells = " | ".join(f"{r['parts_ms'][p]:.1f}" for p in PARTS)
        name = "floor (1 process, 1 thread)" if r["world_size"] == 0 else f"{r['system']} W{r['world_size']}"
        unacc = r["unaccounted_ms"] / r["mean_rank_step_ms"]
        lines.append(
            f"| {name} | {r['dtype']} | {r['median_step_ms']:.1f} | {r.get('step_vs_floor', float('nan')):.2f} | "
            f"{cells} | {unacc:+.1%} | {r.get('compute_excess_ms', float('nan')):+.1f} | "
            f"{r['process_cpu_ms']:.1f} ({r['other_threads_cpu_ms']:.1f}) |"
        )
    return "\n".join(lines)


def stacked_bar_chart(path: Path, rows: Sequence[Mapping[str, Any]], title: str) -> Path:
    """One stacked bar per row (parts in ms per rank-step), written to ``path`` (Agg canvas, no pyplot state)."""
    # optional dependency (the `plots` extra), needed only when the chart is written
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9.0, 4.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    names = [
        ("floor" if r["world_size"] == 0 else f"{r['system']}\nW{r['world_size']}") + f"\n{r['dtype']}" for r in rows
    ]
    bottom = [0.0] * len(rows)
    for part in PARTS:
        values = [r["parts_ms"][part] for r in rows]
        ax.bar(names, values, bottom=bottom, label=LABELS[part])
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("ms per rank-step")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.savefig(path)
    return path

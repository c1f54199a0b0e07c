"""ZeRO-3 on the benchmark Llama against a single-process plain-PyTorch compute floor (CPU, gloo).

    python bench/bench_zero3.py [--steps N] [--worlds 2 4] [--dtype fp32|bf16] [--tiny] [--out bench/results]

For each world size W the engine trains the benchmark model (:mod:`bench_model`) on W ranks launched
with ``python -m torch.distributed.run --standalone`` (``OMP_NUM_THREADS=1``); once, one plain process does the same
*per-rank* work without sharding (same model, micro-batch 4×64, AdamW, clipping, one thread): the compute floor.
Every process runs 2 warm-up steps, then ``--steps`` measured ones, and writes its measurements to a JSON file in a
temporary directory (see ``bench/zero3_worker.py``).

Per system and world size: median / p10 / p90 step time (a ZeRO-3 step's time is the slowest rank's), global
tokens/s, all-gather / reduce-scatter / all-reduce bytes (whole buffers) and calls per step from the comm ledger
(rank 0, mean over measured steps; the JSON adds the per-rank ring "wire" bytes), peak RSS per rank (``ru_maxrss``),
final loss (mean over ranks) and the ratios to the floor. Written to ``<out>/zero3.json`` and ``<out>/zero3.md``
and printed. Nothing here asserts a time.

Reading the numbers: ZeRO-3 ranks process different micro-batches, so the floor's final loss (one micro-batch per
step) is not expected to equal theirs. With W ranks on fewer cores than W the ranks share cores and the time ratio
measures oversubscription as much as the engine. Peak RSS includes ~260 MiB of Python + torch + transformers
imports, and every rank builds the full model before the engine shards it, so it cannot fall below the floor's
model footprint; freed memory is also not always returned to the OS.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORKER = HERE / "zero3_worker.py"
MICRO_BATCH, SEQ_LEN, WARMUP = 4, 64, 2  # mirrors bench_model (not imported: no torch in the driver)
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
MB = 1e6


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values`` with linear interpolation between order statistics."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _run(cmd: list[str], timeout_s: float) -> None:
    """Run one benchmark subprocess; on failure print its output and exit."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    if proc.returncode != 0:
        sys.stderr.write(
            f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}\n"
        )
        raise SystemExit(proc.returncode or 1)


def _worker_args(args: argparse.Namespace, system: str, out_dir: Path) -> list[str]:
    """The ``zero3_worker.py`` command line (script path first) for ``system``."""
    extra = ["--tiny"] if args.tiny else []
    return [
        str(WORKER),
        "--system",
        system,
        "--steps",
        str(args.steps),
        "--warmup",
        str(WARMUP),
        "--dtype",
        args.dtype,
        "--out-dir",
        str(out_dir),
        *extra,
    ]


def run_zero3(args: argparse.Namespace, world: int, tmp: Path) -> list[dict[str, Any]]:
    """Launch ``world`` ZeRO-3 ranks; their JSON records in rank order."""
    out_dir = tmp / f"zero3_w{world}"
    out_dir.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(world),
        *_worker_args(args, "zero3", out_dir),
    ]
    _run(cmd, args.timeout)
    return [json.loads((out_dir / f"zero3_rank{r}.json").read_text()) for r in range(world)]


def run_floor(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Run the single-process floor; its JSON record."""
    out_dir = tmp / "floor"
    out_dir.mkdir()
    _run([sys.executable, *_worker_args(args, "floor", out_dir)], args.timeout)
    return json.loads((out_dir / "floor.json").read_text())


def summarize(system: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One result row from the per-rank records of one run."""
    world = len(ranks)
    n_steps = len(ranks[0]["steps"])
    times = [max(r["steps"][s]["step_ms"] for r in ranks) for s in range(n_steps)]
    median = percentile(times, 50)
    row: dict[str, Any] = {
        "system": system,
        "world_size": world,
        "measured_steps": n_steps,
        "median_step_ms": median,
        "p10_step_ms": percentile(times, 10),
        "p90_step_ms": percentile(times, 90),
        "tokens_per_s": world * MICRO_BATCH * SEQ_LEN / (median / 1e3),
        "peak_rss_mib_per_rank": [round(r["peak_rss_mib"], 1) for r in ranks],
        "peak_rss_mib_max": max(r["peak_rss_mib"] for r in ranks),
        "final_loss": sum(r["steps"][-1]["loss"] for r in ranks) / world,
        "step_times_ms": times,
    }
    has_ledger = "all_gather_bytes" in ranks[0]["steps"][0]  # the floor has no collectives: null, not 0
    for name in COLLECTIVES:
        for unit in ("bytes", "calls"):
            key = f"{name}_{unit}"
            total = sum(s[key] for s in ranks[0]["steps"]) if has_ledger else None
            row[f"{key}_per_step"] = None if total is None else total / n_steps
    for name in COLLECTIVES[:2]:
        key = f"{name}_wire_bytes"
        row[f"{key}_per_step"] = sum(s[key] for s in ranks[0]["steps"]) / n_steps if has_ledger else None
    return row


def _per_step(row: dict[str, Any], name: str, scale: float = MB, calls: bool = True) -> str:
    """One collective's bytes per step (÷ ``scale``) and calls, or a dash where nothing was recorded."""
    nbytes = row[f"{name}_bytes_per_step"]
    if nbytes is None:
        return "–"
    text = f"{nbytes / scale:.2f}" if scale != 1 else f"{nbytes:.0f}"
    return f"{text} ({row[f'{name}_calls_per_step']:.1f})" if calls else text


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Set each row's step-time and peak-RSS ratios to the floor row (the first)."""
    floor = rows[0]
    for row in rows:
        row["step_time_vs_floor"] = row["median_step_ms"] / floor["median_step_ms"]
        row["peak_rss_vs_floor"] = row["peak_rss_mib_max"] / floor["peak_rss_mib_max"]


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The results as a Markdown table."""
    lines = [
        (
            "| system | W | median ms | p10 ms | p90 ms | time ×floor | tok/s (all ranks) | all-gather MB (calls)/step "
            "| reduce-scatter MB (calls)/step | all-reduce B/step | peak RSS MiB/rank (max) | RSS ×floor | final loss |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['system']} | {r['world_size']} | {r['median_step_ms']:.1f} | {r['p10_step_ms']:.1f} | "
            f"{r['p90_step_ms']:.1f} | {r['step_time_vs_floor']:.2f} | {r['tokens_per_s']:.0f} | "
            f"{_per_step(r, 'all_gather')} | {_per_step(r, 'reduce_scatter')} | "
            f"{_per_step(r, 'all_reduce', scale=1, calls=False)} | {r['peak_rss_mib_max']:.0f} | "
            f"{r['peak_rss_vs_floor']:.2f} | {r['final_loss']:.4f} |"
        )
    return "\n".join(lines)


def _git_commit() -> dict[str, Any]:
    """The repository's HEAD commit and whether the tree has changes (``None`` outside git)."""

    def git(*argv: str) -> str | None:
        """``git argv`` in the repository: its stripped stdout, or ``None`` on any failure."""
        try:
            proc = subprocess.run(
                ["git", "-C", str(HERE.parent), *argv], capture_output=True, text=True, timeout=30, check=False
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return proc.stdout.strip() if proc.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain") if commit else None
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def _version(package: str) -> str | None:
    """The installed version of ``package`` (``None`` if it is not installed)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def metadata(args: argparse.Namespace, n_params: int) -> dict[str, Any]:
    """Date, machine, versions, commit and settings of this benchmark run."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "machine": platform.machine(),
            "python": platform.python_version(),
        },
        "versions": {p: _version(p) for p in ("torch", "transformers", "hybridzero")},
        "git": _git_commit(),
        "settings": {
            "steps": args.steps,
            "warmup_steps": WARMUP,
            "worlds": args.worlds,
            "dtype": args.dtype,
            "tiny": args.tiny,
            "micro_batch": MICRO_BATCH,
            "seq_len": SEQ_LEN,
            "n_params": n_params,
            "threads_per_process": 1,
            "bytes": "whole-buffer bytes from the comm ledger",
        },
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="measured steps per run, after 2 warm-up steps")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="world sizes to run ZeRO-3 at")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--tiny", action="store_true", help="the tiny model variant (smoke tests)")
    p.add_argument("--out", type=Path, default=HERE / "results", help="output directory")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per launched run")
    args = p.parse_args(argv)
    if args.steps < 1 or min(args.worlds) < 1:
        p.error("--steps and every --worlds value must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the floor and every world size, write zero3.json and zero3.md, print the table."""
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hz_bench_") as tmp_name:
        tmp = Path(tmp_name)
        floor = run_floor(args, tmp)
        rows = [summarize("floor: plain torch, 1 process", [floor])]
        for world in args.worlds:
            rows.append(summarize("hybridzero ZeRO-3", run_zero3(args, world, tmp)))
    add_ratios(rows)
    table = markdown_table(rows)
    report = {**metadata(args, floor["n_params"]), "results": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "zero3.json").write_text(json.dumps(report, indent=2) + "\n")
    settings = report["settings"]
    header = (
        f"# ZeRO-3 benchmark ({report['date']})\n\n{settings['n_params'] / 1e6:.2f} M params, {args.dtype}, "
        f"micro-batch {MICRO_BATCH}x{SEQ_LEN} per rank, {args.steps} measured steps after {WARMUP} warm-up, "
        f"{report['machine']['cpu_count']} CPUs, torch {report['versions']['torch']}, "
        f"commit {report['git']['commit']}{' (dirty)' if report['git']['dirty'] else ''}. One thread per process; "
        f"bytes are whole buffers (ledger); time ratios above 1 at W > CPUs include oversubscription.\n\n"
    )
    (args.out / "zero3.md").write_text(header + table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

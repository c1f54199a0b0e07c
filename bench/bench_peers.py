"""hybridzero ZeRO-3 side by side with DeepSpeed ZeRO-3 and PyTorch FSDP2 (CPU, gloo).

    python bench/bench_peers.py [--worlds 2 4] [--dtypes fp32 bf16] [--steps 10] [--repeats 3]
                                [--model bench|tiny|100m] [--hpz N] [--out bench/results]

``--tiny`` is an alias of ``--model tiny``; ``--model 100m`` is the ~100 M-parameter point
(:func:`bench_model.overrides_100m`, 100,092,672 parameters). ``--hpz N`` turns on ZeRO++ hpZ with
secondary groups of ``N`` ranks in hybridzero and DeepSpeed (``zero_hpz_partition_size``) and the FSDP2
counterpart, ``reshard_after_forward=N`` on every decoder layer.

Every system trains the benchmark Llama (:mod:`bench_model`) with the same weights, data, micro-batch,
AdamW and clipping, one ``torch.distributed.run`` launch per (system, world size, dtype), ``OMP_NUM_THREADS=1``:
hybridzero through ``bench/zero3_worker.py``, DeepSpeed through ``bench/peer_deepspeed.py`` and FSDP2 through
``bench/peer_fsdp2.py``. Each rank writes a JSON of its per-step measurements to a temporary directory. Runs are
interleaved (hybridzero, DeepSpeed, FSDP2, hybridzero, … for ``--repeats`` rounds), so slow drift of the machine hits
all systems alike; ratios to hybridzero are taken round by round and their median reported.

Per system: median step time (a step's time is its slowest rank's; median over the measured steps of a run, then
median over rounds), ratio to hybridzero, collectives per step (calls and whole-buffer MB, rank 0; hybridzero from
``engine.comm_ledger()``, DeepSpeed from its comms logger, FSDP2 from a c10d dispatch counter), peak RSS per rank.
The fp32 loss curves (mean over ranks, first ``--curve-steps`` steps, warm-up included) are printed side by side
and checked to agree within ``--tolerance``. Results go to ``<out>/peers.json`` and ``<out>/peers.md``, plus per
(world, dtype) a PNG of the loss curves and one of the step times (:mod:`peer_plots`), listed under ``plots`` in
``peers.json``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from peer_common import (
    COLLECTIVE_KINDS,
    MODEL_CHOICES,
    collective_kind,
    deepspeed_available,
)
from peer_plots import plots_markdown, write_plots

WORKERS: dict[str, tuple[Path, list[str]]] = {
    "hybridzero": (HERE / "zero3_worker.py", ["--system", "zero3"]),
    "deepspeed": (HERE / "peer_deepspeed.py", []),
    "fsdp2": (HERE / "peer_fsdp2.py", []),
}
"""Worker script and its extra arguments per system (read-only)."""
FILE_PREFIX: dict[str, str] = {"hybridzero": "zero3", "deepspeed": "deepspeed", "fsdp2": "fsdp2"}
LEDGER_KINDS: tuple[str, ...] = ("all_gather", "reduce_scatter", "all_reduce")


def launch(system: str, world: int, dtype: str, args: argparse.Namespace, out_dir: Path) -> list[dict[str, Any]]:
    """Run ``world`` ranks of ``system`` under torchrun; their JSON records in rank order, warm-up steps included."""
    script, extra = WORKERS[system]
    total = args.warmup + args.steps
    # zero3_worker records measured steps only: run it with no warm-up and slice here, like the peers' records
    steps = (
        ["--steps", str(total), "--warmup", "0"]
        if system == "hybridzero"
        else ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    )
    cmd = [
        sys.executable,
        "-W",
        "ignore::FutureWarning",
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(world),
        str(script),
        *extra,
        *steps,
        "--dtype",
        dtype,
        "--out-dir",
        str(out_dir),
        "--model",
        args.model,
        "--hpz",
        str(args.hpz),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{system} W={world} {dtype} failed ({proc.returncode}): {' '.join(cmd)}\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return [json.loads((out_dir / f"{FILE_PREFIX[system]}_rank{r}.json").read_text()) for r in range(world)]


def step_collectives(system: str, step: dict[str, Any], world: int) -> dict[str, dict[str, float]]:
    """One step's calls and whole-buffer bytes per collective kind, or ``{}`` where nothing was recorded."""
    kinds: dict[str, dict[str, float]] = {}
    if system == "hybridzero":
        for kind in LEDGER_KINDS:
            kinds[kind] = {"calls": step[f"{kind}_calls"], "bytes": step[f"{kind}_bytes"]}
        return kinds
    for name, entry in step.get("collectives", {}).items():
        kind = collective_kind(name)
        # DeepSpeed's logger sizes an all-gather by its input shard: scale to the gathered (whole) buffer
        scale = world if system == "deepspeed" and kind == "all_gather" else 1
        slot = kinds.setdefault(kind, {"calls": 0, "bytes": 0})
        slot["calls"] += entry["calls"]
        slot["bytes"] += entry["bytes"] * scale
    return kinds


def summarize_run(system: str, ranks: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Median step time, collectives per step, peak RSS and loss curve of one launch."""
    world, n_steps = len(ranks), len(ranks[0]["steps"])
    times = [max(r["steps"][s]["step_ms"] for r in ranks) for s in range(warmup, n_steps)]
    measured = ranks[0]["steps"][warmup:]
    per_step = [step_collectives(system, s, world) for s in measured]
    collectives: dict[str, dict[str, float]] = {}
    for kind in COLLECTIVE_KINDS:
        present = [p[kind] for p in per_step if kind in p]
        if present:
            collectives[kind] = {
                "calls": sum(p["calls"] for p in present) / len(per_step),
                "bytes": sum(p["bytes"] for p in present) / len(per_step),
            }
    return {
        "median_step_ms": statistics.median(times),
        "step_times_ms": times,
        "collectives_per_step": collectives or None,
        "peak_rss_mib_per_rank": [round(r["peak_rss_mib"], 1) for r in ranks],
        "losses": [sum(r["steps"][s]["loss"] for r in ranks) / world for s in range(n_steps)],
        "n_params": ranks[0]["n_params"],
    }


def run_all(args: argparse.Namespace, systems: list[str]) -> dict[tuple[int, str, str], list[dict[str, Any]]]:
    """Every (world, dtype, system) run ``--repeats`` times, interleaved system by system; runs per key."""
    runs: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="hz_peers_") as tmp_name:
        for rnd in range(args.repeats):
            for world in args.worlds:
                for dtype in args.dtypes:
                    for system in systems:
                        out_dir = Path(tmp_name) / f"r{rnd}_w{world}_{dtype}_{system}"
                        out_dir.mkdir()
                        print(f"[round {rnd + 1}/{args.repeats}] {system} W={world} {dtype}", flush=True)
                        ranks = launch(system, world, dtype, args, out_dir)
                        runs.setdefault((world, dtype, system), []).append(summarize_run(system, ranks, args.warmup))
    return runs


def aggregate(runs: dict[tuple[int, str, str], list[dict[str, Any]]], systems: list[str]) -> list[dict[str, Any]]:
    """One row per (world, dtype, system): medians over rounds and the paired per-round ratio to hybridzero."""
    rows = []
    for (world, dtype, system), reps in runs.items():
        base = runs[(world, dtype, "hybridzero")] if "hybridzero" in systems else None
        ratios = [r["median_step_ms"] / b["median_step_ms"] for r, b in zip(reps, base)] if base else []
        rows.append(
            {
                "system": system,
                "world_size": world,
                "dtype": dtype,
                "rounds": len(reps),
                "median_step_ms": statistics.median(r["median_step_ms"] for r in reps),
                "per_round_median_ms": [round(r["median_step_ms"], 2) for r in reps],
                "time_vs_hybridzero": statistics.median(ratios) if ratios else None,
                "per_round_ratio": [round(x, 3) for x in ratios],
                "collectives_per_step": reps[0]["collectives_per_step"],
                "peak_rss_mib_per_rank": reps[0]["peak_rss_mib_per_rank"],
                "peak_rss_mib_max": statistics.median(max(r["peak_rss_mib_per_rank"]) for r in reps),
                "final_loss": reps[0]["losses"][-1],
            }
        )
    return rows


def loss_agreement(
    runs: dict[tuple[int, str, str], list[dict[str, Any]]], systems: list[str], n_steps: int
) -> list[dict[str, Any]]:
    """Per fp32 world size: the first ``n_steps`` loss curves (round 1) and their max distance to hybridzero's."""
    checks = []
    for world in sorted({w for (w, d, _) in runs if d == "fp32"}):
        curves = {s: runs[(world, "fp32", s)][0]["losses"][:n_steps] for s in systems if (world, "fp32", s) in runs}
        ref = curves.get("hybridzero") or next(iter(curves.values()))
        diffs = {s: max(abs(a - b) for a, b in zip(c, ref)) for s, c in curves.items()}
        checks.append(
            {"world_size": world, "curves": curves, "max_abs_diff": diffs, "max_abs_diff_overall": max(diffs.values())}
        )
    return checks


def _fmt_collectives(coll: dict[str, dict[str, float]] | None, kind: str) -> str:
    """``MB (calls)`` of one collective kind per step, ``n/a`` where the system exposes nothing."""
    if coll is None:
        return "n/a"
    if kind not in coll:
        return "0"
    return f"{coll[kind]['bytes'] / 1e6:.2f} ({coll[kind]['calls']:.1f})"


def markdown(rows: list[dict[str, Any]], checks: list[dict[str, Any]], tolerance: float) -> str:
    """The result table and the loss curves as Markdown."""
    lines = [
        (
            "| system | W | dtype | median ms/step | ×hybridzero (paired median) | all-gather MB (calls) "
            "| reduce-scatter MB (calls) | all-reduce MB (calls) | other MB (calls) | peak RSS MiB/rank "
            "| final loss |"
        ),
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        ratio = "–" if r["time_vs_hybridzero"] is None else f"{r['time_vs_hybridzero']:.2f}"
        coll = [_fmt_collectives(r["collectives_per_step"], k) for k in COLLECTIVE_KINDS]
        rss = ", ".join(f"{x:.0f}" for x in r["peak_rss_mib_per_rank"])
        lines.append(
            f"| {r['system']} | {r['world_size']} | {r['dtype']} | {r['median_step_ms']:.1f} | {ratio} | "
            f"{' | '.join(coll)} | {rss} | {r['final_loss']:.4f} |"
        )
    for check in checks:
        systems = list(check["curves"])
        verdict = "AGREE" if check["max_abs_diff_overall"] <= tolerance else "**DISAGREE**"
        lines += [
            "",
            f"fp32 loss curves, W={check['world_size']} (mean over ranks; max |diff| vs hybridzero: "
            + ", ".join(f"{s} {d:.2e}" for s, d in check["max_abs_diff"].items())
            + f"; tolerance {tolerance:g}: {verdict})",
            "",
            "| step | " + " | ".join(systems) + " |",
            "|---:|" + "---:|" * len(systems),
        ]
        for i, values in enumerate(zip(*check["curves"].values())):
            lines.append(f"| {i + 1} | " + " | ".join(f"{v:.6f}" for v in values) + " |")
    return "\n".join(lines)


def _version(package: str) -> str | None:
    """The installed version of ``package`` (``None`` if it is not installed)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def metadata(args: argparse.Namespace, systems: list[str]) -> dict[str, Any]:
    """Date, machine, versions and settings of this run."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "machine": platform.machine(),
            "python": platform.python_version(),
        },
        "versions": {p: _version(p) for p in ("torch", "transformers", "hybridzero", "deepspeed")},
        "settings": {
            "systems": systems,
            "worlds": args.worlds,
            "dtypes": args.dtypes,
            "steps": args.steps,
            "warmup_steps": args.warmup,
            "repeats": args.repeats,
            "model": args.model,
            "tiny": args.model == "tiny",
            "hpz_partition_size": args.hpz,
            "threads_per_process": 1,
            "loss_tolerance": args.tolerance,
            "bytes": "whole buffers per step, rank 0",
        },
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2])
    p.add_argument("--dtypes", choices=("fp32", "bf16"), nargs="+", default=["fp32"])
    p.add_argument("--steps", type=int, default=10, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps before them")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    p.add_argument("--curve-steps", type=int, default=12, help="loss-curve steps shown and compared")
    p.add_argument("--tolerance", type=float, default=1e-4, help="max |loss difference| called agreement")
    p.add_argument(
        "--model",
        choices=MODEL_CHOICES,
        default="bench",
        help="model variant: bench (7.1 M), tiny (smoke tests), 100m (100.09 M)",
    )
    p.add_argument("--tiny", dest="model", action="store_const", const="tiny", help="alias of --model tiny")
    p.add_argument("--hpz", type=int, default=1, help="ZeRO++ hpZ secondary group size (1: off)")
    p.add_argument(
        "--systems",
        choices=list(WORKERS),
        nargs="+",
        default=list(WORKERS),
        help="systems to run (ratios need hybridzero)",
    )
    p.add_argument("--no-plots", dest="plots", action="store_false", help="skip the PNG charts")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per launch")
    args = p.parse_args(argv)
    if min(args.steps, args.repeats, args.curve_steps, args.hpz, *args.worlds) < 1 or args.warmup < 0:
        p.error("--steps, --repeats, --curve-steps, --hpz and --worlds must be >= 1, --warmup >= 0")
    if any(w % args.hpz for w in args.worlds):
        p.error(f"--hpz {args.hpz} must divide every world size {args.worlds}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run every system interleaved, write peers.json and peers.md, print the table and curves."""
    args = parse_args(argv)
    systems = [s for s in WORKERS if s in args.systems]
    if "deepspeed" in systems and not deepspeed_available():
        print("NOTE: deepspeed is not importable; DeepSpeed is skipped (pip install '.[bench]')", flush=True)
        systems.remove("deepspeed")
    runs = run_all(args, systems)
    rows = aggregate(runs, systems)
    checks = loss_agreement(runs, systems, args.curve_steps)
    meta = metadata(args, systems)
    meta["settings"]["n_params"] = next(iter(runs.values()))[0]["n_params"]
    args.out.mkdir(parents=True, exist_ok=True)
    label = args.model + (f", hpZ {args.hpz}" if args.hpz > 1 else "")
    plots = write_plots(runs, systems, args.out, label) if args.plots else []
    report = {**meta, "results": rows, "loss_agreement": checks, "plots": plots}
    (args.out / "peers.json").write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(rows, checks, args.tolerance)
    header = (
        f"# hybridzero vs DeepSpeed ZeRO-3 vs FSDP2 ({meta['date']})\n\n"
        f"{meta['settings']['n_params'] / 1e6:.2f} M params (model {label}); "
        f"{args.steps} measured steps after {args.warmup} "
        f"warm-up; {args.repeats} interleaved rounds; {meta['machine']['cpu_count']} CPUs "
        f"({meta['machine']['platform']}); versions {meta['versions']}. One thread per rank, gloo.\n\n"
    )
    if args.hpz > 1:
        header += (
            f"hpZ {args.hpz}: DeepSpeed's comms logger records an all-gather by its input and not its group, "
            f"so its all-gather MB (input × W) overstates the secondary (intra-group) gathers by "
            f"W / {args.hpz}; its call counts are exact.\n\n"
        )
    charts = f"\n\n{plots_markdown(plots)}" if plots else ""
    (args.out / "peers.md").write_text(header + text + charts + "\n")
    print(text)
    for check in checks:
        if check["max_abs_diff_overall"] > args.tolerance:
            print(
                f"\n!!! LOSS CURVES DISAGREE at W={check['world_size']}: max |diff| "
                f"{check['max_abs_diff_overall']:.3e} > {args.tolerance:g} !!!",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

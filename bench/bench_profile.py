"""Where one ZeRO-3 training step's time goes, per rank, next to the compute floor measured in the same run.

    python bench/bench_profile.py [--worlds 1 2 4] [--dtypes fp32 bf16] [--steps 5] [--repeats 1] [--model bench]

For each dtype: the floor (one process, one thread, one rank's batch, unsharded forward + backward + clip + AdamW;
``bench/profile_worker.py --system floor``), then hybridzero ZeRO-3 at each world size under
``python -m torch.distributed.run`` (``OMP_NUM_THREADS=1``), with the engine's step timer on
(:class:`hybridzero.comm.timing.StepTimer`, carried by the comm ledger). Runs are interleaved (floor, W1, W2, W4,
floor, ...) for ``--repeats`` rounds and the rounds' records pooled. Each step is split into fwd+bwd math, optimizer
math, communication per collective, copies, hooks/bookkeeping and idle/waiting (``bench/profile_parts.py``).

Writes ``<out>/profile.json`` (every rank-step's regions), ``<out>/profile.md`` (the table) and
``<out>/profile.png`` (stacked bars; needs the ``plots`` extra, skipped with a note without matplotlib). Exit status
1 if any rank-step's parts miss its measured step time by more than ``--tolerance`` (default 5%). Nothing here
asserts a time. DeepSpeed is not needed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORKER = HERE / "profile_worker.py"
sys.path.insert(0, str(HERE))  # profile_parts sits beside this script (bench/ is not a package)

from profile_parts import add_floor_ratios, check_accounting, markdown_table, stacked_bar_chart, summarize  # noqa: I001


def _run(cmd: list[str], timeout_s: float, source: Path | None = None) -> None:
    """Run one worker command (with ``source`` first on ``PYTHONPATH``: another checkout's hybridzero); on failure
    print its output and exit."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if source is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(source), env.get("PYTHONPATH", "")])
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # every launch starts its own rendezvous
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    if proc.returncode != 0:
        sys.stderr.write(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-8000:]}\n")
        raise SystemExit(proc.returncode or 1)


def run_one(
    args: argparse.Namespace, dtype: str, world: int, out_dir: Path, source: Path | None = None
) -> list[dict[str, Any]]:
    """One run (``world`` 0: the floor; ``source``: hybridzero from that checkout); its per-rank records."""
    out_dir.mkdir(parents=True)
    common = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--dtype", dtype, "--model", args.model]
    common += ["--clock", args.clock]
    if args.reduce_bucket is not None and world > 0:
        common += ["--reduce-bucket", str(args.reduce_bucket)]
    if world == 0:
        _run([sys.executable, str(WORKER), "--system", "floor", *common, "--out-dir", str(out_dir)], args.timeout)
        return [json.loads((out_dir / "floor.json").read_text())]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world)]
    _run([*launch, str(WORKER), "--system", "zero3", *common, "--out-dir", str(out_dir)], args.timeout, source)
    return [json.loads((out_dir / f"zero3_rank{r}.json").read_text()) for r in range(world)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--dtypes", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"])
    p.add_argument("--steps", type=int, default=5, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps before them")
    p.add_argument("--repeats", type=int, default=1, help="interleaved rounds")
    p.add_argument("--model", choices=("bench", "tiny", "100m"), default="bench")
    p.add_argument("--reduce-bucket", type=int, default=None, help="reduce_bucket_size (default: the benchmark's)")
    p.add_argument(
        "--compare",
        type=Path,
        default=None,
        help="root of another checkout that has the step timer (hybridzero/comm/timing.py with StepTimer.clock, e.g. "
        "`git archive` of an older commit): its engine runs as 'before', interleaved with this one's",
    )
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall time (the profile), or each main thread's CPU time (before/after comparisons on a loaded machine)",
    )
    p.add_argument("--tolerance", type=float, default=0.05, help="allowed |step - sum of parts| / step")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per launched run")
    args = p.parse_args(argv)
    if args.steps < 1 or args.repeats < 1 or min(args.worlds) < 1:
        p.error("--steps, --repeats and every --worlds value must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the interleaved rounds, write profile.json / .md / .png, print the table; 1 if the accounting fails."""
    args = parse_args(argv)
    pooled: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    systems: list[tuple[str, Path | None]] = [("hybridzero", None)]
    if args.compare is not None:
        systems.append(("before", args.compare.resolve()))
    with tempfile.TemporaryDirectory(prefix="hz_profile_") as tmp:
        for rnd in range(args.repeats):
            for dtype in args.dtypes:
                runs = [("floor", 0, None)] + [(name, w, src) for w in args.worlds for name, src in systems]
                for name, world, source in runs:
                    out_dir = Path(tmp) / f"r{rnd}_{dtype}_w{world}_{name}"
                    ranks = run_one(args, dtype, world, out_dir, source)
                    merged = pooled.setdefault((dtype, world, name), [dict(r, steps=[]) for r in ranks])
                    for into, rank in zip(merged, ranks):
                        into["steps"] += rank["steps"]
    rows = [summarize(name, d, ranks) for (d, w, name), ranks in pooled.items()]
    add_floor_ratios(rows)
    failures = [msg for ranks in pooled.values() for msg in check_accounting(ranks, args.tolerance)]
    table = markdown_table(rows)
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "accounting_failures": failures,
        "results": rows,
        "raw": [{"dtype": d, "world": w, "system": n, "ranks": ranks} for (d, w, n), ranks in pooled.items()],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile.json").write_text(json.dumps(report, indent=1) + "\n")
    try:
        stacked_bar_chart(args.out / "profile.png", rows, f"Step profile, {args.model} model, ms per rank-step")
        chart = "\n\n![step profile](profile.png)\n"
    except ImportError:
        chart = "\n\n(no chart: matplotlib, the `plots` extra, is not installed)\n"
    header = (
        f"# Step profile ({report['date']})\n\nModel {args.model}, {args.steps} measured steps after {args.warmup} "
        f"warm-up, {args.repeats} interleaved round(s), clock {args.clock}, {os.cpu_count()} CPUs, one thread per "
        "process. Parts in ms per rank-step (mean over ranks and steps); step = median over steps of the slowest "
        "rank.\n\n"
    )
    (args.out / "profile.md").write_text(header + table + chart)
    print(table)
    for msg in failures:
        print(f"ACCOUNTING: {msg}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())

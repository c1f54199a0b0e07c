"""Every benchmark of issue #9 in one command, gathered into ``summary.md`` and ``summary.json``.

    .venv/bin/python bench/run_all.py                 # the full set (hours on a small CPU machine)
    .venv/bin/python bench/run_all.py --quick         # smoke version: tiny models, 1 step, into <out>/quick
    .venv/bin/python bench/run_all.py --only peers generate --out /tmp/results

Parts (each a separate ``python bench/...`` process, run in this order; ``--only`` picks a subset):

* ``peers``: ``bench_peers.py`` (hybridzero vs DeepSpeed ZeRO-3 vs FSDP2), worlds 2 and 4, fp32 and bf16, 10 measured
  steps, 3 interleaved rounds, into ``<out>`` (``peers.json``, ``peers.md``, PNG charts);
* ``peers_100m``: the same at the ~100 M-parameter point (``--model 100m``), world 2, fp32, 3 measured steps after 1
  warm-up, 1 round, into ``<out>/peers_100m``;
* ``peers_hpz``: ZeRO++ hpZ at world 4, fp32: hybridzero and DeepSpeed with ``zero_hpz_partition_size`` 2, FSDP2
  with ``reshard_after_forward=2`` (``--hpz 2``), into ``<out>/peers_hpz2``;
* ``generate``: ``bench_generate.py`` (plain / hybrid engine / ZeRO-3 / FSDP2 unshard / DeepSpeed generate), into
  ``<out>``;
* ``zeropp``: ``bench_zeropp.py`` (ZeRO-3 / hpZ / qwZ / qgZ bytes at world 4 as 2 × 2), into ``<out>``.

``--quick`` runs the same parts on the tiny model (the ``peers_100m`` part too: it then checks the plumbing, not the
100 M point) with one step and one round, into ``<out>/quick``, so real results are never overwritten. A part that
fails is recorded (exit status, end of its output) and the rest still run; the exit status is 1 if any failed.
``summary.json`` holds the date, the machine (``platform``, CPU count, Python), the versions of torch, transformers,
DeepSpeed and hybridzero, and per part its command, exit status, seconds and its JSON report; ``summary.md`` holds
every part's Markdown tables (chart links rewritten to stay valid from the summary's directory).
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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PARTS: tuple[str, ...] = ("peers", "peers_100m", "peers_hpz", "generate", "zeropp")
"""``--only`` choices, in the order they run."""


@dataclass(frozen=True)
class Part:
    """One benchmark process: its script's arguments, output directory and the report files it writes there."""

    name: str
    argv: list[str]
    out: Path
    json_name: str
    md_name: str


def plan(out: Path, quick: bool) -> list[Part]:
    """The parts of a full run (or of a ``--quick`` one) writing under ``out``, in run order."""
    if quick:
        one = ["--model", "tiny", "--steps", "1", "--warmup", "0", "--repeats", "1", "--curve-steps", "1"]
        peers = ["--worlds", "2", "--dtypes", "fp32", "bf16", *one]
        big = ["--worlds", "2", "--dtypes", "fp32", *one]
        hpz = ["--worlds", "4", "--dtypes", "fp32", "--hpz", "2", *one]
        generate = ["--tiny", "--batch", "2", "--prompt-len", "8", "--new-tokens", "4", "--repeats", "1"]
        zeropp = ["--steps", "1", "--tiny"]
    else:
        peers = ["--worlds", "2", "4", "--dtypes", "fp32", "bf16", "--steps", "10", "--repeats", "3"]
        big = [
            "--model",
            "100m",
            "--worlds",
            "2",
            "--dtypes",
            "fp32",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--repeats",
            "1",
            "--curve-steps",
            "4",
        ]
        hpz = ["--worlds", "4", "--dtypes", "fp32", "--hpz", "2", "--steps", "10", "--repeats", "3"]
        generate = []
        zeropp = ["--steps", "10"]
    peers_script, generate_script, zeropp_script = (
        str(HERE / f) for f in ("bench_peers.py", "bench_generate.py", "bench_zeropp.py")
    )
    return [
        Part("peers", [peers_script, *peers, "--out", str(out)], out, "peers.json", "peers.md"),
        Part(
            "peers_100m",
            [peers_script, *big, "--out", str(out / "peers_100m")],
            out / "peers_100m",
            "peers.json",
            "peers.md",
        ),
        Part(
            "peers_hpz",
            [peers_script, *hpz, "--out", str(out / "peers_hpz2")],
            out / "peers_hpz2",
            "peers.json",
            "peers.md",
        ),
        Part("generate", [generate_script, *generate, "--out", str(out)], out, "generate.json", "generate.md"),
        Part("zeropp", [zeropp_script, *zeropp, "--out", str(out)], out, "zeropp.json", "zeropp.md"),
    ]


def run_part(part: Part, timeout: float) -> dict[str, Any]:
    """Run one part (its output streamed to ours); its command, exit status, seconds and report (or error)."""
    cmd = [sys.executable, "-W", "ignore::FutureWarning", *part.argv]
    print(f"\n=== {part.name}: {' '.join(cmd)}", flush=True)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        status, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as error:
        status, output = -1, f"timed out after {timeout:g} s\n{error.stdout or ''}{error.stderr or ''}"
    seconds = time.perf_counter() - start
    record: dict[str, Any] = {
        "name": part.name,
        "command": cmd,
        "returncode": status,
        "seconds": round(seconds, 1),
        "out_dir": str(part.out),
    }
    print(output[-4000:] if status else _tail_table(output), flush=True)
    if status == 0:
        record["report"] = json.loads((part.out / part.json_name).read_text())
        record["markdown"] = (part.out / part.md_name).read_text()
    else:
        record["error_tail"] = output[-6000:] if isinstance(output, str) else str(output)
    return record


def _tail_table(output: str) -> str:
    """The Markdown table lines of a part's output (what it printed as its result)."""
    return "\n".join(line for line in output.splitlines() if line.startswith("|"))


def _relink(markdown: str, report: dict[str, Any], prefix: str) -> str:
    """``markdown`` with its chart links (``report["plots"]``) made relative to the summary's directory."""
    if not prefix:
        return markdown
    for plot in report.get("plots", []):
        markdown = markdown.replace(f"]({plot['path']})", f"]({prefix}/{plot['path']})")
    return markdown


def _version(package: str) -> str | None:
    """The installed version of ``package`` (``None`` if it is not installed)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def metadata(quick: bool) -> dict[str, Any]:
    """Date, machine and versions of this run."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "machine": platform.machine(),
            "python": platform.python_version(),
        },
        "versions": {p: _version(p) for p in ("torch", "transformers", "deepspeed", "hybridzero")},
        "quick": quick,
    }


def summary_markdown(meta: dict[str, Any], records: list[dict[str, Any]], out: Path) -> str:
    """The summary document: header, then every part's tables (or its failure)."""
    machine, versions = meta["machine"], meta["versions"]
    lines = [
        f"# hybridzero benchmarks{' (quick smoke run)' if meta['quick'] else ''}",
        "",
        f"Date {meta['date']}; machine {machine['platform']}, {machine['cpu_count']} CPUs, Python "
        f"{machine['python']}; " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".",
        "",
    ]
    for record in records:
        lines += [f"## {record['name']} ({record['seconds']:.0f} s)", "", "`" + " ".join(record["command"]) + "`", ""]
        if record["returncode"] != 0:
            lines += [f"**FAILED** (exit {record['returncode']}):", "", "```", record["error_tail"][-2000:], "```", ""]
            continue
        prefix = os.path.relpath(record["out_dir"], out)
        body = _relink(record["markdown"], record["report"], "" if prefix == "." else prefix)
        lines += [line.replace("# ", "### ", 1) if line.startswith("# ") else line for line in body.splitlines()]
        lines.append("")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke version: tiny models, 1 step, into <out>/quick")
    p.add_argument("--only", choices=PARTS, nargs="+", default=list(PARTS), help="run only these parts")
    p.add_argument("--out", type=Path, default=HERE / "results", help="results directory")
    p.add_argument("--timeout", type=float, default=6 * 3600.0, help="seconds allowed per part")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the chosen parts, write ``summary.json`` and ``summary.md``; 1 if any part failed."""
    args = parse_args(argv)
    out = args.out / "quick" if args.quick else args.out
    out.mkdir(parents=True, exist_ok=True)
    meta = metadata(args.quick)
    records = [run_part(part, args.timeout) for part in plan(out, args.quick) if part.name in args.only]
    (out / "summary.json").write_text(json.dumps({**meta, "parts": records}, indent=2) + "\n")
    (out / "summary.md").write_text(summary_markdown(meta, records, out) + "\n")
    failed = [r["name"] for r in records if r["returncode"] != 0]
    print(f"\nwrote {out / 'summary.md'} and {out / 'summary.json'}" + (f"; FAILED: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

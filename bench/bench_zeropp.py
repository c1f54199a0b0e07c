"""ZeRO++ on the benchmark model at world 4 as 2 nodes x 2: bytes per step by group and step time.

    python bench/bench_zeropp.py [--steps 10] [--tiny] [--out bench/results]

Groups: ``world`` spans both nodes; ``hpz`` and ``node`` stay inside a node; ``cross`` links the two nodes. A
rank's cross-node traffic is what it sends on ``world`` and ``cross`` collectives. The median step time leaves out
the first step (unless there is only one). ``--tiny``: the test suite's small Llama instead of the benchmark model
(smoke runs). Writes ``zeropp.json`` and ``zeropp.md``; never asserts a time.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.harness.spawn import WorldPool
from tests.workers.zeropp import zeropp_run

SYSTEMS: dict[str, dict[str, Any]] = {
    "zero3": {},
    "hpz": {"zero_hpz_partition_size": 2},
    "qwz": {"zero_quantized_weights": True},
    "qgz": {"zero_quantized_gradients": True},
    "all three": {"zero_hpz_partition_size": 2, "zero_quantized_weights": True, "zero_quantized_gradients": True},
}
CROSS_GROUPS = ("world", "cross")


def row(name: str, result: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """One table row: bytes per step split into cross-node and intra-node, median step time, final loss."""
    cross = sum(v for k, v in result["bytes_per_step"].items() if k.split("/")[1] in CROSS_GROUPS)
    intra = sum(v for k, v in result["bytes_per_step"].items() if k.split("/")[1] not in CROSS_GROUPS)
    base_cross = sum(v for k, v in base["bytes_per_step"].items() if k.split("/")[1] in CROSS_GROUPS)
    return {
        "system": name,
        "cross_node_mb": cross / 1e6,
        "intra_node_mb": intra / 1e6,
        "cross_vs_zero3": cross / base_cross,
        "median_step_ms": 1e3 * statistics.median(result["seconds"][1:] or result["seconds"]),
        "final_loss": result["losses"][-1],
        "bytes_per_step": result["bytes_per_step"],
    }


def main(argv: list[str] | None = None) -> None:
    """Run every system in one pool (interleaved order), print and write the table."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--tiny", action="store_true", help="the test suite's small Llama (smoke runs)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    results = {}
    with WorldPool(4, env={"LOCAL_WORLD_SIZE": "2"}) as pool:
        for name, extra in SYSTEMS.items():
            results[name] = pool.run(zeropp_run, extra, args.steps, not args.tiny, timeout=1800)[0]
    rows = [row(n, r, results["zero3"]) for n, r in results.items()]
    lines = [
        "| system | cross-node MB/step | intra-node MB/step | cross-node vs ZeRO-3 | median step ms | final loss |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['system']} | {r['cross_node_mb']:.2f} | {r['intra_node_mb']:.2f} | {r['cross_vs_zero3']:.2f} | "
        f"{r['median_step_ms']:.0f} | {r['final_loss']:.4f} |"
        for r in rows
    ]
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": datetime.now(timezone.utc).isoformat(),
        "machine": platform.platform(),
        "steps": args.steps,
        "model": "tiny (test-suite Llama)" if args.tiny else "bench",
        "world": "4 as 2 nodes x 2 (simulated: LOCAL_WORLD_SIZE=2)",
    }
    (args.out / "zeropp.json").write_text(json.dumps({"metadata": meta, "rows": rows}, indent=2) + "\n")
    (args.out / "zeropp.md").write_text(table + "\n")


if __name__ == "__main__":
    main()

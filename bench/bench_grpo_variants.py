"""Whole GRPO iterations of our ``grpo`` step in its variants, same work, interleaved: rollouts on the hybrid engine
(``hf``) or on vLLM (``vllm``), training forwards padded or packed (``--packing_samples``).

    python bench/bench_grpo_variants.py [--worlds 1 2] [--rounds 2] [--iterations 16] [--sft_dir DIR]
        [--variants hf hf+pack vllm]

The work is the arithmetic demo's GRPO step (``bench/rl_peer_ours.py grpo``: 8 completions of 16 prompts per
iteration, 2 optimizer steps, answers of at most 8 tokens, fp32, gloo on CPU) from one SFT checkpoint (trained here
once at world 2 unless ``--sft_dir``). In every round and world the variants run one after the other, in an order
rotated each round, so load drifts hit all of them. Reported per run: ``samples/s`` = completions / the iterations'
summed wall time (generation + scoring + training; vLLM's engine start is outside it, its weight syncs inside), the
generation share of that time, and the padding share of the training forwards. Ratios are to ``hf`` of the same
round and world. Writes ``OUT/grpo_variants.json`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VARIANTS: dict[str, list[str]] = {
    "hf": [],
    "hf+pack": ["--packing_samples"],
    "vllm": ["--rollout_engine", "vllm"],
    "vllm+pack": ["--rollout_engine", "vllm", "--packing_samples"],
}


def _torchrun(world: int, args: list[str], log: Path) -> None:
    """``bench/rl_peer_ours.py ARGS`` under torch.distributed.run with ``world`` ranks (raises on failure)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with log.open("w") as f:
        rc = subprocess.run([*cmd, str(ROOT / "bench" / "rl_peer_ours.py"), *args], stdout=f, stderr=f, env=env)
    if rc.returncode:
        raise RuntimeError(f"rl_peer_ours.py {' '.join(args)} failed (exit {rc.returncode}); see {log}")


def _run(variant: str, world: int, sft: str, out: Path, iterations: int) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    args = ["grpo", "--sft_dir", sft, "--out", str(out), "--iterations", str(iterations), *VARIANTS[variant]]
    _torchrun(world, args, out / "run.log")
    res = json.loads((out / "ours_result.json").read_text())
    return {
        "variant": variant,
        "world": world,
        "samples_per_s": res["completions"] / res["train_s"],
        "generation_share": res["generation_s"] / res["train_s"],
        "pad_fraction": res["pad_fraction"],
        "reward_last": res["reward_last"],
    }


def _table(runs: list[dict[str, Any]], variants: list[str]) -> list[str]:
    lines = [
        "| world | variant | samples/s (range) | / hf (range) | generation share | pad fraction |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for world in sorted({r["world"] for r in runs}):
        for v in variants:
            mine = [r for r in runs if r["world"] == world and r["variant"] == v]
            ratios = [
                r["samples_per_s"] / b["samples_per_s"]
                for r in mine
                for b in runs
                if b["world"] == world and b["variant"] == "hf" and b["round"] == r["round"]
            ]
            sps = [r["samples_per_s"] for r in mine]
            lines.append(
                f"| {world} | {v} | {min(sps):.0f}-{max(sps):.0f} | {min(ratios):.2f}-{max(ratios):.2f} | "
                f"{statistics.mean(r['generation_share'] for r in mine):.2f} | "
                f"{statistics.mean(r['pad_fraction'] for r in mine):.2f} |"
            )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iterations", type=int, default=16)
    ap.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=["hf", "hf+pack", "vllm"])
    ap.add_argument("--sft_dir", default=None)
    ap.add_argument("--out", default="runs/bench_grpo_variants")
    a = ap.parse_args()
    if "hf" not in a.variants:
        ap.error("--variants must include hf (the ratios' baseline)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    sft = a.sft_dir
    if sft is None:
        _torchrun(2, ["sft", "--out", str(out / "sft")], out / "sft.log")
        sft = str(out / "sft" / "step1_sft")
    runs: list[dict[str, Any]] = []
    for rnd in range(a.rounds):
        order = a.variants[rnd % len(a.variants) :] + a.variants[: rnd % len(a.variants)]
        for world in a.worlds:
            for v in order:
                t0 = time.perf_counter()
                r = _run(v, world, sft, out / f"r{rnd}_w{world}_{v}", a.iterations)
                r.update(round=rnd, process_s=time.perf_counter() - t0)
                runs.append(r)
                print(json.dumps(r), flush=True)
    lines = _table(runs, a.variants)
    (out / "grpo_variants.json").write_text(json.dumps({"args": vars(a), "runs": runs}, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

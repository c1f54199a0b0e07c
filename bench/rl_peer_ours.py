"""Our side of ``bench/bench_rl_peers.py`` (run under torchrun): the arithmetic demo's SFT, GRPO or evaluation.

    torchrun --nproc_per_node W bench/rl_peer_ours.py sft  --out DIR [--quick]
    torchrun --nproc_per_node W bench/rl_peer_ours.py grpo --sft_dir DIR --out DIR --iterations N \
        [--rollout_engine hf|vllm] [--packing_samples]
    torchrun --nproc_per_node W bench/rl_peer_ours.py chat --model DIR --prompts FILE --out DIR --iterations N \
        [--rollout_engine hf|vllm] [--packing_samples]
    python bench/rl_peer_ours.py eval --model DIR [--limit N]

``sft`` trains the start checkpoint both trainers share (``DIR/step1_sft``). ``grpo`` runs the demo's GRPO step
(:func:`hybridzero.rlhf.demo.arith_run.arith_grpo_settings`) for ``N`` iterations and writes ``DIR/ours_result.json``
(rank 0): the loop time (sum over iterations of generation + scoring + training, ``e2e_s``), completions, the final
model directory. ``chat`` is the same GRPO step on the realistic shape of ``bench/bench_rl_smollm2.py`` (an
instruct model, :mod:`rl_chat_task`'s prompts and reward; 8 prompts x 4 completions of at most 64 tokens an
iteration, one update). ``eval`` prints one JSON line of held-out scores (greedy and sampled) of any HF model directory
(ours or TRL's: the same evaluator scores both).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

import hybridzero
from hybridzero.rlhf.demo.arith_eval import eval_prompts, evaluate_arith
from hybridzero.rlhf.demo.arith_run import GLOBAL_PROMPTS, GROUP, arith_grpo_settings, arith_sft_settings
from hybridzero.rlhf.engines import world_comm
from hybridzero.rlhf.settings import GRPOSettings
from hybridzero.rlhf.steps.rl.trainer import train_step3
from hybridzero.rlhf.steps.sft import train_sft

CHAT_PROMPTS, CHAT_GROUP, CHAT_ANSWER_LEN, CHAT_LR = 8, 4, 64, 1e-6
"""The chat shape: prompts and completions an iteration (all ranks), completion cap, learning rate (constant)."""


def chat_settings(a: argparse.Namespace, world: int) -> GRPOSettings:
    """GRPO on ``a.model`` with the chat task: no reference model or KL, fp32, ZeRO-3 + hybrid engine."""
    per_gen = CHAT_PROMPTS * CHAT_GROUP // world
    engine: dict[str, Any] = {"rollout_engine": a.rollout_engine}
    if a.rollout_engine == "vllm":
        engine["vllm_dtype"] = a.vllm_dtype
        engine["vllm_kv_cache_gb"] = 0.5  # ~46 KB a token in fp32 (30 layers x k,v x 3 kv heads x 64); ample
    return GRPOSettings(
        dtype="fp32",
        **engine,
        data_path=[a.prompts],
        data_split="0,0,10",
        output_dir=str(Path(a.out) / "step3_grpo"),
        actor_model_name_or_path=a.model,
        actor_zero_stage=3,
        per_device_generation_batch_size=per_gen,
        per_device_training_batch_size=per_gen,
        group_size=CHAT_GROUP,
        ppo_epochs=1,
        max_prompt_seq_len=64,
        max_answer_seq_len=CHAT_ANSWER_LEN,
        actor_learning_rate=CHAT_LR,
        lr_scheduler_type="constant",
        num_warmup_steps=0,
        grpo_kl_coef=0.0,
        num_train_epochs=1,
        max_steps=a.iterations,
        enable_hybrid_engine=True,
        packing_samples=bool(a.packing_samples),
        print_every=1000,
        progress=False,
        seed=3,
        resume=False,
        reward_funcs=[f"{Path(__file__).resolve().parent / 'rl_chat_task.py'}:sum_reward"],
    )


def _grpo(a: argparse.Namespace, world: int, rank: int) -> None:
    if a.stage == "chat":
        _run(chat_settings(a, world), a, world, rank, CHAT_PROMPTS * CHAT_GROUP)
        return
    base = arith_grpo_settings(Path(a.out), a.sft_dir, world=world, rollout_engine=a.rollout_engine)
    extra = {"packing_samples": True} if a.packing_samples else {}
    s = GRPOSettings(
        **{
            **base.model_dump(exclude_unset=True),
            **extra,
            "max_steps": a.iterations,
            "progress": False,
            "print_every": 1000,
        }
    )
    _run(s, a, world, rank, GLOBAL_PROMPTS * GROUP)


def _run(s: GRPOSettings, a: argparse.Namespace, world: int, rank: int, per_iteration: int) -> None:
    """Train ``s``; rank 0 writes ``ours_result.json`` (loop time, phase times, rewards, padding share)."""
    t0 = time.perf_counter()
    m = train_step3(s)
    wall = time.perf_counter() - t0
    if rank == 0:
        h = m["history"]
        result = {
            "world": world,
            "train_s": sum(x["e2e_s"] for x in h),
            "generation_s": sum(x["generation_s"] for x in h),
            "training_s": sum(x["training_s"] for x in h),
            "train_step3_s": wall,
            "iterations": len(h),
            "completions": len(h) * per_iteration,
            "rewards": [x["reward"] for x in h],
            "iteration_s": [x["e2e_s"] for x in h],
            "generation_iteration_s": [x["generation_s"] for x in h],
            "training_iteration_s": [x["training_s"] for x in h],
            "weight_sync_iteration_s": [x.get("weight_sync_s", 0.0) for x in h],
            "model": m["models"]["actor"],
            "reward_last": h[-1]["reward"],
            "pad_fraction": sum(x.get("pad_fraction", 0.0) for x in h) / len(h),
            "rollout_engine": a.rollout_engine,
            "packing_samples": bool(a.packing_samples),
        }
        (Path(a.out) / "ours_result.json").write_text(json.dumps(result, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=("sft", "grpo", "chat", "eval"))
    ap.add_argument("--prompts", default=None, help="chat: the prompt file (bench/rl_chat_task.py's format)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--sft_dir", default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--iterations", type=int, default=32)
    ap.add_argument("--limit", type=int, default=None, help="eval: the first N held-out prompts")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rollout_engine", choices=("hf", "vllm"), default="hf", help="grpo: where rollouts run")
    ap.add_argument("--packing_samples", action="store_true", help="grpo: packed training forwards")
    ap.add_argument("--vllm_dtype", choices=("fp32", "bf16"), default=None, help="chat: vLLM's dtype (default fp32)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    hybridzero.init_distributed()
    comm = world_comm()
    if a.stage == "sft":
        train_sft(arith_sft_settings(Path(a.out), a.quick, comm.world_size).model_copy(update={"progress": False}))
    elif a.stage in ("grpo", "chat"):
        _grpo(a, comm.world_size, comm.rank)
    else:
        prompts = eval_prompts(a.limit)
        scores = {m: evaluate_arith(a.model, prompts, do_sample=m == "sampled") for m in ("greedy", "sampled")}
        if comm.rank == 0:
            print("EVAL " + json.dumps(scores))


if __name__ == "__main__":
    main()

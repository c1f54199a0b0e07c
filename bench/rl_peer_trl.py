"""TRL side of ``bench/bench_rl_peers.py``: TRL's ``GRPOTrainer`` on the arithmetic demo, one run.

    torchrun --nproc_per_node W bench/rl_peer_trl.py --sft_dir DIR --out DIR --iterations N
    torchrun --nproc_per_node W bench/rl_peer_trl.py --task chat --sft_dir MODEL --prompts FILE --out DIR --iterations N

Same work as our side (:func:`hybridzero.rlhf.demo.arith_run.arith_grpo_settings`): the SFT checkpoint, the RL
prompts (``demo_data/arith/prompts.jsonl``, with their ``answer`` column), the reward functions and weights of
:mod:`hybridzero.rlhf.demo.rewards`, 8 completions of 16 prompts per generation (128 sequences, all ranks together)
trained in 2 optimizer steps of 64, completion length 8, temperature 1, lr 2e-4 and 5 warmup steps (schedule:
TRL's cosine to 0, ours cosine to 10% of the lr: the one difference TRL's names leave), no KL (``beta`` 0, so no
reference model), one pass over each generation (``num_iterations`` 1), the per-sequence ``grpo`` loss, fp32 on
CPU with gloo. Writes ``OUT/trl_result.json`` (rank 0): wall time of the training loop (first step begin to last
step end), completions, and the final model in ``OUT/final``. ``--task chat`` is the realistic shape of
``bench/bench_rl_smollm2.py`` (``bench/rl_peer_ours.py chat``'s work: :mod:`rl_chat_task`'s prompts and reward,
8 prompts x 4 completions of at most 64 tokens, one update an iteration, lr 1e-6 constant). Importing ``trl``
here only: the project never depends on it.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from datasets import Dataset
from rl_chat_task import sum_reward
from trl import GRPOConfig, GRPOTrainer

from hybridzero.rlhf.demo.arith import arith_data_dir
from hybridzero.rlhf.demo.arith_run import ARITH_REWARD_WEIGHTS, GLOBAL_PROMPTS, GROUP
from hybridzero.rlhf.demo.rewards import answer_format, exact_answer


class _Clock(transformers.TrainerCallback):
    """Wall-clock stamps of the training loop (the first step's begin and every step's end)."""

    def __init__(self) -> None:
        self.begin: float | None = None
        self.ends: list[float] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.begin is None:
            self.begin = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.ends.append(time.perf_counter())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sft_dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--iterations", type=int, required=True, help="generation rounds (2 optimizer steps each)")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--task", choices=("arith", "chat"), default="arith")
    ap.add_argument("--prompts", default=None, help="chat: the prompt file")
    ap.add_argument("--use_vllm", action="store_true", help="TRL's own vLLM rollouts, vllm_mode='colocate'")
    a = ap.parse_args()
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if a.task == "chat":
        rows = [json.loads(line) for line in Path(a.prompts).read_text().splitlines()]
        cfg, funcs, per_iteration = _chat_config(a, world), [sum_reward], 8 * 4
    else:
        rows = [json.loads(line) for line in (arith_data_dir() / "prompts.jsonl").read_text().splitlines()]
        cfg, funcs, per_iteration = _arith_config(a, world), [exact_answer, answer_format], GLOBAL_PROMPTS * GROUP
    _train(a, cfg, funcs, rows, world, per_iteration)


def _common(a: argparse.Namespace, world: int) -> dict[str, Any]:
    """The keys both tasks share: CPU/gloo, fp32, no KL, one pass, per-sequence loss, no saving or logging."""
    return dict(
        output_dir=str(Path(a.out) / "trl"),
        use_cpu=True,
        ddp_backend="gloo" if world > 1 else None,
        temperature=1.0,
        top_k=0,
        beta=0.0,
        num_iterations=1,
        loss_type="grpo",
        scale_rewards="group",
        max_grad_norm=1.0,
        logging_steps=10,
        save_strategy="no",
        report_to=[],
        seed=a.seed,
        bf16=False,
        fp16=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
        **_vllm_keys(a),
    )


def _vllm_keys(a: argparse.Namespace) -> dict[str, Any]:
    """TRL's colocated vLLM (each rank its own in-process engine), as TRL's docs configure it; none without the flag.

    On a CPU host vLLM sizes its KV cache from ``VLLM_CPU_KVCACHE_SPACE`` (GiB), not from the memory share: it is
    set to 1 GiB, the KV cache our ``vllm`` variants get (``--vllm_kv_cache_gb`` default); with vLLM's own default
    a rank reached ~10.8 GB RSS here and was OOM-killed at world 2 on the 24 GB machine."""
    if not a.use_vllm:
        return {}
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3, vllm_enable_sleep_mode=False)


def _chat_config(a: argparse.Namespace, world: int) -> GRPOConfig:
    """8 prompts x 4 completions (<= 64 tokens) a generation, one optimizer step on them, lr 1e-6 constant."""
    return GRPOConfig(
        **{**_common(a, world), "logging_steps": 1},  # the reward of every iteration
        per_device_train_batch_size=8 * 4 // world,
        steps_per_generation=1,
        num_generations=4,
        max_completion_length=64,
        learning_rate=1e-6,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_steps=a.iterations,
    )


def _arith_config(a: argparse.Namespace, world: int) -> GRPOConfig:
    """The arithmetic demo's GRPO step in TRL's names (16 prompts x 8 completions, 2 updates a generation)."""
    return GRPOConfig(
        **_common(a, world),
        per_device_train_batch_size=GLOBAL_PROMPTS * GROUP // 2 // world,
        steps_per_generation=2,
        num_generations=GROUP,
        max_completion_length=8,
        learning_rate=a.lr,
        lr_scheduler_type="cosine",
        warmup_steps=5,
        max_steps=2 * a.iterations,
        reward_weights=list(ARITH_REWARD_WEIGHTS),
    )


def _train(
    a: argparse.Namespace, cfg: GRPOConfig, funcs: list[Any], rows: list[dict[str, Any]], world: int, per_it: int
) -> None:
    """Train, then (main process) save the model and write ``trl_result.json``."""
    tok = transformers.AutoTokenizer.from_pretrained(a.sft_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(a.sft_dir, dtype=torch.float32)
    clock = _Clock()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=funcs,
        args=cfg,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
        callbacks=[clock],
    )
    trainer.train()
    if trainer.accelerator.is_main_process:
        trainer.save_model(str(Path(a.out) / "final"))
        tok.save_pretrained(str(Path(a.out) / "final"))
        assert clock.begin is not None
        generations = len(clock.ends) // cfg.steps_per_generation
        result = {
            "world": world,
            "train_s": clock.ends[-1] - clock.begin,
            "steps": len(clock.ends),
            "completions": generations * per_it,
            "step_s": [b - e for e, b in zip([clock.begin, *clock.ends[:-1]], clock.ends)],
            "log": [r for r in trainer.state.log_history if "reward" in r],
        }
        (Path(a.out) / "trl_result.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

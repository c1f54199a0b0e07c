"""TRL side of ``bench/bench_rl_peers.py``: TRL's ``GRPOTrainer`` on the arithmetic demo, one run.

    torchrun --nproc_per_node W bench/rl_peer_trl.py --sft_dir DIR --out DIR --iterations N

Same work as our side (:func:`hybridzero.rlhf.demo.arith_run.arith_grpo_settings`): the SFT checkpoint, the RL
prompts (``demo_data/arith/prompts.jsonl``, with their ``answer`` column), the reward functions and weights of
:mod:`hybridzero.rlhf.demo.rewards`, 8 completions of 16 prompts per generation (128 sequences, all ranks together)
trained in 2 optimizer steps of 64, completion length 8, temperature 1, lr 2e-4 and 5 warmup steps (schedule:
TRL's cosine to 0, ours cosine to 10% of the lr: the one difference TRL's names leave), no KL (``beta`` 0, so no
reference model), one pass over each generation (``num_iterations`` 1), the per-sequence ``grpo`` loss, fp32 on
CPU with gloo. Writes ``OUT/trl_result.json`` (rank 0): wall time of the training loop (first step begin to last
step end), completions, and the final model in ``OUT/final``. Importing ``trl`` here only: the project never
depends on it.
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
    a = ap.parse_args()
    torch.set_num_threads(1)
    rows = [json.loads(line) for line in (arith_data_dir() / "prompts.jsonl").read_text().splitlines()]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = GRPOConfig(
        output_dir=str(Path(a.out) / "trl"),
        use_cpu=True,
        ddp_backend="gloo" if world > 1 else None,
        per_device_train_batch_size=GLOBAL_PROMPTS * GROUP // 2 // world,
        steps_per_generation=2,
        num_generations=GROUP,
        max_completion_length=8,
        temperature=1.0,
        top_k=0,
        learning_rate=a.lr,
        lr_scheduler_type="cosine",
        warmup_steps=5,
        max_steps=2 * a.iterations,
        beta=0.0,
        num_iterations=1,
        loss_type="grpo",
        scale_rewards="group",
        reward_weights=list(ARITH_REWARD_WEIGHTS),
        max_grad_norm=1.0,
        logging_steps=10,
        save_strategy="no",
        report_to=[],
        seed=a.seed,
        bf16=False,
        fp16=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    tok = transformers.AutoTokenizer.from_pretrained(a.sft_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(a.sft_dir, dtype=torch.float32)
    clock = _Clock()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[exact_answer, answer_format],
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
        result = {
            "world": world,
            "train_s": clock.ends[-1] - clock.begin,
            "steps": len(clock.ends),
            "completions": 2 * a.iterations * GLOBAL_PROMPTS * GROUP // 2,
            "log": [r for r in trainer.state.log_history if "reward" in r],
        }
        (Path(a.out) / "trl_result.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

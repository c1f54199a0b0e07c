"""Hugging Face ``Trainer`` with Ulysses sequence parallelism (DeepSpeed's ALST path) on hybridzero.

    torchrun --nproc_per_node 2 examples/hf_trainer_ulysses.py --model_dir TINY_MODEL --out DIR --sp 2

``TrainingArguments(parallelism_config=ParallelismConfig(sp_size=2, sp_backend="deepspeed"), deepspeed=cfg)`` as in
Hugging Face's sequence-parallelism guide; the first line makes the ``import deepspeed`` inside transformers and
accelerate resolve to hybridzero, so Accelerate's ``register_with_transformers`` / ``UlyssesSPDataLoaderAdapter`` /
``deepspeed.utils.groups`` calls and Trainer's SP loss aggregation run on hybridzero's Ulysses. ``--sp 1`` runs the
same script without sequence parallelism (the reference). Each rank writes ``DIR/rank<r>.json``: the loss of every
micro-batch it ran and what the run saw.
"""

import hybridzero.as_deepspeed  # noqa: F401, I001  -- the one line: `import deepspeed` now means hybridzero

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
import transformers
from accelerate import PartialState
from accelerate.utils import ParallelismConfig


def ds_config(stage: int) -> dict[str, Any]:
    """ZeRO with SGD at a fixed learning rate (the parity test compares losses step by step)."""
    return {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "SGD", "params": {"lr": "auto"}},
    }


def rows(n: int, seq: int, vocab: int, prompt: int, seed: int = 1234) -> list[dict[str, torch.Tensor]]:
    """``n`` fixed random rows; the first ``prompt`` tokens carry no loss (labels -100), as in SFT data."""
    ids = torch.randint(3, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[:, :prompt] = -100
    return [{"input_ids": i, "labels": lab} for i, lab in zip(ids, labels, strict=True)]


def cpu_host_state() -> dict[str, Any]:
    """On a host without GPUs: a gloo process state marked as DeepSpeed's (see examples/hf_trainer_zero3.py)."""
    if torch.cuda.is_available():
        return {}
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    return {"accelerator_config": {"use_configured_state": True}}


class RecordingTrainer(transformers.Trainer):
    """Remembers the loss ``compute_loss`` returned for every micro-batch of this rank."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.recorded: list[float] = []

    def compute_loss(
        self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.recorded.append(float((out[0] if return_outputs else out).item()))
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_dir", required=True, help="a Hugging Face model directory (an SDPA Llama)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--sp", type=int, default=2, help="sequence parallel size (1: no sequence parallelism)")
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2, help="per-device batch")
    parser.add_argument("--grad_accum", type=int, default=1)
    parser.add_argument("--seq_len", type=int, default=13)
    parser.add_argument("--prompt", type=int, default=5, help="leading tokens of every row without loss")
    args = parser.parse_args()
    out = Path(args.out)
    parallel = {}
    if args.sp > 1:
        parallel["parallelism_config"] = ParallelismConfig(sp_size=args.sp, sp_backend="deepspeed")
    training_args = transformers.TrainingArguments(
        output_dir=str(out / "trainer"),
        deepspeed=ds_config(args.stage),
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.grad_accum,
        max_steps=args.steps,
        learning_rate=0.1,
        lr_scheduler_type="constant",
        save_strategy="no",
        logging_steps=1,
        report_to=[],
        train_sampling_strategy="sequential",
        seed=0,
        disable_tqdm=True,
        **parallel,
        **cpu_host_state(),
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    world = training_args.world_size
    data = rows(args.steps * args.grad_accum * args.batch * world, args.seq_len, model.config.vocab_size, args.prompt)
    trainer = RecordingTrainer(model=model, args=training_args, train_dataset=data)
    trainer.train()
    record = {
        "rank": training_args.process_index,
        "world": world,
        "losses": trainer.recorded,
        "engine": type(trainer.model_wrapped).__module__ + "." + type(trainer.model_wrapped).__name__,
        "attn": model.config._attn_implementation,
        "global_step": trainer.state.global_step,
    }
    Path(out, f"rank{training_args.process_index}.json").write_text(json.dumps(record))
    # every rank done, then the process groups (the SP groups included) torn down before the interpreter exits: left
    # to interpreter shutdown, their teardown once aborted a rank after a finished run (SIGABRT, "terminate called")
    trainer.accelerator.wait_for_everyone()
    PartialState().destroy_process_group()


if __name__ == "__main__":
    main()

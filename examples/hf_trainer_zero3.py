"""Hugging Face ``Trainer`` with ``TrainingArguments(deepspeed=...)`` on hybridzero: one added line, no DeepSpeed.

    torchrun --nproc_per_node 2 examples/hf_trainer_zero3.py --model_dir TINY_MODEL --out DIR --stage 3

The first line below makes the ``import deepspeed`` inside transformers and accelerate resolve to hybridzero
(DeepSpeed is not installed; a real one would be used instead). Everything else is a plain Trainer script: a
DeepSpeed config with ``"auto"`` values that Trainer fills, the model loaded with ``from_pretrained`` after the
``TrainingArguments`` exist (so under ZeRO-3 it is built inside ``deepspeed.zero.Init`` and its weights are loaded
through ``GatheredParameters``), a checkpoint every ``--save_steps`` steps, ``save_model`` at the end.

With ``--resume_from_checkpoint CKPT`` it continues that run instead. Each rank writes ``DIR/rank<r>.json``: the loss
of every micro-batch it ran, whether ZeRO-3 was detected, the engine's class and the DeepSpeed version Trainer saw.
"""

import hybridzero.as_deepspeed  # noqa: F401, I001  -- the one line: `import deepspeed` now means hybridzero

import argparse
import importlib.metadata
import json
import os
from pathlib import Path
from typing import Any

import torch
import transformers
from accelerate import PartialState
from transformers.integrations import is_deepspeed_zero3_enabled


def ds_config(stage: int) -> dict[str, Any]:
    """A DeepSpeed config as Trainer users write it: batch sizes, clipping and optimizer values left to Trainer."""
    return {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
    }


def token_rows(n: int, seq: int, vocab: int, seed: int = 1234) -> list[dict[str, torch.Tensor]]:
    """``n`` fixed random sequences as Trainer rows (labels = inputs: causal LM loss over every token)."""
    ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": row, "labels": row} for row in ids]


def cpu_host_state() -> dict[str, Any]:
    """Only on a host without GPUs (these tests): accelerate finds no device backend there and, with ``deepspeed=``,
    TrainingArguments passes it none, so the run would think it is alone. A process state made first with gloo,
    marked as DeepSpeed's, is what TrainingArguments then uses (``use_configured_state``). GPU hosts need nothing."""
    if torch.cuda.is_available():
        return {}
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    return {"accelerator_config": {"use_configured_state": True}}


class RecordingTrainer(transformers.Trainer):
    """A Trainer that remembers the loss of every micro-batch this rank computed (for the parity test): the value
    ``compute_loss`` returns, which Trainer normalizes for accumulation (the micro-batch's mean loss / accumulation
    steps when every micro-batch has the same number of label tokens, as here)."""

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
    parser.add_argument("--model_dir", required=True, help="a Hugging Face model directory")
    parser.add_argument("--out", required=True)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save_steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2, help="per-device batch")
    parser.add_argument("--grad_accum", type=int, default=1, help="gradient accumulation steps")
    parser.add_argument("--seq_len", type=int, default=9)
    parser.add_argument("--resume_from_checkpoint", default=None)
    args = parser.parse_args()
    out = Path(args.out)
    training_args = transformers.TrainingArguments(
        output_dir=str(out / "trainer"),
        deepspeed=ds_config(args.stage),  # a dict or a JSON file path
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.grad_accum,
        max_steps=args.steps,
        learning_rate=1e-2,
        weight_decay=0.01,
        lr_scheduler_type="linear",
        warmup_steps=1,
        max_grad_norm=1.0,
        save_strategy="steps",
        save_steps=args.save_steps,
        logging_steps=1,
        report_to=[],
        train_sampling_strategy="sequential",
        seed=0,
        disable_tqdm=True,
        **cpu_host_state(),
    )
    # after TrainingArguments: under ZeRO-3 the model is partitioned as it is built (deepspeed.zero.Init)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    world = training_args.world_size
    rows = token_rows(args.steps * args.grad_accum * args.batch * world, args.seq_len, model.config.vocab_size)
    trainer = RecordingTrainer(model=model, args=training_args, train_dataset=rows)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    if args.resume_from_checkpoint is None:
        trainer.save_model(str(out / "final"))  # full weights (ZeRO-3: gathered, stage3_gather_16bit_...)
    record = {
        "rank": training_args.process_index,
        "world": world,
        "losses": trainer.recorded,
        "zero3": is_deepspeed_zero3_enabled(),
        "engine": type(trainer.model_wrapped).__module__ + "." + type(trainer.model_wrapped).__name__,
        "deepspeed_version": importlib.metadata.version("deepspeed"),
        "global_step": trainer.state.global_step,
    }
    tag = "resumed" if args.resume_from_checkpoint else "run"
    Path(out, f"{tag}_rank{training_args.process_index}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()

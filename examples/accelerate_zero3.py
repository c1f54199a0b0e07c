"""Hugging Face Accelerate with its DeepSpeed plugin on hybridzero: one added line, no DeepSpeed.

    torchrun --nproc_per_node 2 examples/accelerate_zero3.py --model_dir TINY_MODEL --out DIR --stage 3

The first line below makes the ``import deepspeed`` inside accelerate and transformers resolve to hybridzero. The rest
is Accelerate's documented DeepSpeed loop: a ``DeepSpeedPlugin`` from a DeepSpeed config (``zero3_init_flag`` on, so
``from_pretrained`` builds the model inside ``deepspeed.zero.Init``), ``accelerator.prepare`` of model, torch
optimizer and dataloader, ``accelerator.backward``, and ``accelerator.get_state_dict`` + ``save_pretrained`` for the
full weights at the end. Each rank writes ``DIR/rank<r>.json`` with the loss of every micro-batch it ran.
"""

import hybridzero.as_deepspeed  # noqa: F401, I001  -- the one line: `import deepspeed` now means hybridzero

import argparse
import json
from pathlib import Path

import torch
import transformers
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs
from torch.utils.data import DataLoader
from transformers.integrations import is_deepspeed_zero3_enabled

LR, WEIGHT_DECAY, CLIP = 1e-2, 0.01, 1.0


def token_rows(n: int, seq: int, vocab: int, seed: int = 1234) -> torch.Tensor:
    """``n`` fixed random token sequences."""
    return torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_dir", required=True, help="a Hugging Face model directory")
    parser.add_argument("--out", required=True)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2, help="per-device batch")
    parser.add_argument("--seq_len", type=int, default=9)
    args = parser.parse_args()
    ds_config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": args.stage, "stage3_gather_16bit_weights_on_model_save": True},
    }
    plugin = DeepSpeedPlugin(hf_ds_config=ds_config, zero3_init_flag=args.stage == 3)
    # on a host without GPUs accelerate finds no device backend by itself: name gloo (NCCL machines need nothing)
    backend = [] if torch.cuda.is_available() else [InitProcessGroupKwargs(backend="gloo")]
    accelerator = Accelerator(deepspeed_plugin=plugin, kwargs_handlers=backend)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    rows = token_rows(args.steps * args.batch * accelerator.num_processes, args.seq_len, model.config.vocab_size)
    loader = DataLoader(rows, batch_size=args.batch, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    model.train()
    for ids in loader:
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    state = accelerator.get_state_dict(model)  # every rank calls it (ZeRO-3: a gather)
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(Path(args.out, "final"), state_dict=state)
    accelerator.wait_for_everyone()
    record = {
        "rank": accelerator.process_index,
        "world": accelerator.num_processes,
        "losses": losses,
        "zero3": is_deepspeed_zero3_enabled(),
        "engine": type(model).__module__ + "." + type(model).__name__,
    }
    Path(args.out, f"rank{accelerator.process_index}.json").write_text(json.dumps(record))
    accelerator.end_training()


if __name__ == "__main__":
    main()

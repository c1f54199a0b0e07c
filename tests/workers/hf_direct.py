"""Per-rank body: the Hugging Face scripts' training run on hybridzero's engine directly (``hybridzero.initialize``,
no Trainer, no Accelerate, no alias), for the tests that compare the scripts' loss curves with it."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from tests.integration.hf_common import BATCH, CLIP, LR, STEPS, WEIGHT_DECAY, linear_warmup, token_rows


def train_direct(model_dir: str, stage: int, warmup_schedule: bool) -> list[float]:
    """This rank's loss at every step: the engine built from a DeepSpeed config (AdamW, clipping), the same rows in
    the same sharding as the scripts, and (``warmup_schedule``) Trainer's linear schedule as a client scheduler."""
    import hybridzero

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    model = transformers.AutoModelForCausalLM.from_pretrained(Path(model_dir), dtype=torch.float32)
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
    }

    def schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(opt, linear_warmup)

    engine, *_ = hybridzero.initialize(model=model, config=config, lr_scheduler=schedule if warmup_schedule else None)
    rows = token_rows(STEPS * BATCH * world, int(model.config.vocab_size))
    losses = []
    for step in range(STEPS):
        ids = rows[(step * world + rank) * BATCH : (step * world + rank + 1) * BATCH]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.destroy()
    return losses

"""Per-rank function of the DeepSpeed-checkpoint tests: resume a converted DeepSpeed checkpoint on hybridzero and
train the steps DeepSpeed trained after its save, on the same global batches."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch


def resume(case_dir: str, converted: str, stage: int | None) -> dict[str, Any]:
    """Load ``converted`` into a fresh engine built from the fixture's DeepSpeed JSON (at ``stage`` when given),
    record what was carried, train the fixture's last ``m_steps`` steps; per step this rank's loss and the lr."""
    import transformers

    import hybridzero

    hybridzero.init_distributed()
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    record = json.loads((Path(case_dir) / "record.json").read_text())
    config = copy.deepcopy(record["config"])
    global_batch = record["world_size"] * config["train_micro_batch_size_per_gpu"]
    config["train_micro_batch_size_per_gpu"] = global_batch // world
    if stage is not None:
        config["zero_optimization"]["stage"] = stage
    torch.manual_seed(1)  # other values than DeepSpeed's start: everything must come from the checkpoint
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**record["hf_config"], attn_implementation="eager"))
    engine, *_ = hybridzero.initialize(model=model, config=config)
    engine.load_checkpoint(converted)
    leaf_state = next(iter(engine.optimizer.state.values()))
    carried = {
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "lr": engine.get_lr()[0],
        "step": float(leaf_state["step"]),
        "last_batch_iteration": engine.lr_scheduler.last_batch_iteration,
        "moments": sorted(k for k in leaf_state if k != "step"),
    }
    n, m = record["n_steps"], record["m_steps"]
    losses, lrs = [], []
    for s in range(n, n + m):
        ids = torch.tensor([sample for per_rank in record["token_ids"][s] for sample in per_rank])
        mine = ids[rank * (global_batch // world) : (rank + 1) * (global_batch // world)]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach().float()))
        lrs.append(engine.get_lr()[0])
    params = engine.full_parameters()
    return {"carried": carried, "losses": losses, "lr": lrs, "params": params if rank == 0 else None}


def train_with_csv_monitor(case_dir: str, out: str) -> list[float]:
    """Two steps of the fixture's model and DeepSpeed JSON plus a ``csv_monitor`` block writing to ``out``; this
    rank's losses."""
    import transformers

    import hybridzero

    hybridzero.init_distributed()
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    record = json.loads((Path(case_dir) / "record.json").read_text())
    config = copy.deepcopy(record["config"])
    config["train_micro_batch_size_per_gpu"] = 4 // world
    config["csv_monitor"] = {"enabled": True, "output_path": out, "job_name": "job"}
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**record["hf_config"], attn_implementation="eager"))
    engine, *_ = hybridzero.initialize(model=model, config=config)
    losses = []
    for s in range(2):
        ids = torch.tensor([sample for per_rank in record["token_ids"][s] for sample in per_rank])
        mine = ids[rank * (4 // world) : (rank + 1) * (4 // world)]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    engine.destroy()
    return losses

"""Per-rank bodies of the DeepSpeed-Chat optimizer tests."""

from __future__ import annotations

import transformers

from hybridzero.rlhf.data.demo_task import build_tokenizer, demo_model_config
from hybridzero.rlhf.settings import SFTSettings
from hybridzero.rlhf.steps.supervised import supervised_engine


def optimizer_groups_run(weight_decay: float) -> list[tuple[float, int]]:
    """``(weight_decay, elements this rank's optimizer steps)`` of each optimizer group of a step-1 ZeRO-3 engine."""
    model = transformers.AutoModelForCausalLM.from_config(demo_model_config(build_tokenizer()))
    s = SFTSettings(zero_stage=3, dtype="fp32", weight_decay=weight_decay, per_device_train_batch_size=1)
    engine, _, _ = supervised_engine(model, s, 64, "groups")
    return [(float(g["weight_decay"]), sum(p.numel() for p in g["params"])) for g in engine.optimizer.param_groups]

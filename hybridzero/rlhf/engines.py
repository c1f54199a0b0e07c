"""Engines of the RLHF steps: DeepSpeed configs from step settings, model loading, the EMA actor.

Roles (DeepSpeed-Chat's step 3): the **actor** (trained; ZeRO stage and hybrid engine from the settings), the
**reference** (the initial actor, inference only: no optimizer state at all), the **critic** (trained; initialised
from the reward model), the **reward model** (inference only) and an optional **EMA** copy of the actor (inference
only, updated shard by shard from the actor's fp32 master: no communication).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hybridzero.rlhf.models import ValueHeadModel

__all__ = ["OptimSpec", "build_engine", "dropout_overrides", "ds_config", "ema_update", "load_causal_lm",
           "load_tokenizer", "scheduler_block"]


@dataclass(frozen=True)
class OptimSpec:
    """One trained engine's optimizer and schedule."""

    lr: float
    weight_decay: float
    schedule: str  # cosine | linear | constant
    warmup_steps: int
    total_steps: int


def scheduler_block(spec: OptimSpec) -> dict[str, Any]:
    """The DeepSpeed ``scheduler`` block of ``spec``: linear warmup from 0 (HF ``get_scheduler``'s shape), or none
    at all (``warmup_steps == 0``: the first step already runs at ``lr``); cosine decays to 10% of ``lr``."""
    warmup = min(spec.warmup_steps, max(spec.total_steps - 1, 0))
    floor = 0.0 if warmup else 1.0  # without warmup the "warmup start" is the peak itself
    common = {"warmup_num_steps": max(warmup, 1), "warmup_type": "linear"}
    if spec.schedule == "constant":
        return {"type": "WarmupLR", "params": {"warmup_min_lr": spec.lr * floor, "warmup_max_lr": spec.lr, **common}}
    if spec.schedule == "linear":
        return {"type": "WarmupDecayLR", "params": {"warmup_min_lr": spec.lr * floor, "warmup_max_lr": spec.lr,
                                                      "total_num_steps": max(spec.total_steps, warmup + 1, 2),
                                                      **common}}
    return {"type": "WarmupCosineLR", "params": {"total_num_steps": max(spec.total_steps, warmup + 1, 3),
                                                   "warmup_min_ratio": floor, "cos_min_ratio": 0.1, **common}}


def ds_config(*, stage: int, dtype: str, micro_batch: int, world_size: int, grad_accum: int = 1,
              optim: OptimSpec | None = None, clipping: float = 1.0, hybrid: bool = False) -> dict[str, Any]:
    """A DeepSpeed JSON config for one engine; ``optim=None`` builds an inference-only engine."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": micro_batch * grad_accum * world_size,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 16, "loss_scale_window": 100, "hysteresis": 2}
    if optim is not None:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": optim.lr, "weight_decay": optim.weight_decay,
                                                        "betas": [0.9, 0.95], "eps": 1e-8}}
        cfg["scheduler"] = scheduler_block(optim)
        cfg["gradient_clipping"] = clipping
    if hybrid:
        cfg["hybrid_engine"] = {"enabled": True}
    return cfg


def build_engine(model: nn.Module, config: dict[str, Any], *, checkpointing: bool = False) -> Any:
    """``hybridzero.initialize`` on ``model`` (activation checkpointing enabled first when asked)."""
    import hybridzero

    if checkpointing:
        if isinstance(model, ValueHeadModel):
            model.gradient_checkpointing_enable()
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, *_ = hybridzero.initialize(model=model, config=config)
    return engine


def load_tokenizer(path: str) -> Any:
    """The tokenizer of a model directory, or the demo tokenizer for ``"demo"``; prompts are left-padded."""
    if path == "demo":
        from hybridzero.rlhf.demo_task import build_tokenizer

        tok = build_tokenizer()
    else:
        import transformers

        tok = transformers.AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    return tok


def load_causal_lm(path: str, tokenizer: Any, seed: int) -> tuple[nn.Module, Any]:
    """``(model, hf_config)``: the demo model built from scratch (seeded) for ``"demo"``, else the HF directory."""
    import transformers

    if path == "demo":
        from hybridzero.rlhf.demo_task import demo_model_config

        hf_config = demo_model_config(tokenizer)
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    else:
        hf_config = transformers.AutoConfig.from_pretrained(path)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for key, value in dropout_overrides(hf_config).items():
        setattr(hf_config, key, value)
    model.to(torch.float32)
    return model, hf_config


_DROPOUT_KEYS: tuple[str, ...] = ("dropout", "attention_dropout", "hidden_dropout", "activation_dropout",
                                   "resid_pdrop", "embd_pdrop", "attn_pdrop", "hidden_dropout_prob",
                                   "attention_probs_dropout_prob")


def dropout_overrides(hf_config: Any) -> dict[str, float]:
    """``{key: 0.0}`` for every dropout probability the config has: RLHF log-probabilities must be deterministic."""
    return {key: 0.0 for key in _DROPOUT_KEYS if isinstance(getattr(hf_config, key, None), float)}


def ema_update(ema: Any, actor: Any, beta: float) -> None:
    """``ema = beta * ema + (1 - beta) * actor`` on every rank's fp32 master shard, then propagated to the EMA
    engine's compute copies. Needs identical group layouts (same model, stage and world): asserted."""
    if len(ema.groups) != len(actor.groups):
        raise ValueError(f"EMA engine has {len(ema.groups)} groups, actor {len(actor.groups)}: build both from "
                         "the same model with the same ZeRO stage")
    with torch.no_grad():
        for mine, theirs in zip(ema.groups, actor.groups):
            if mine.master.shape != theirs.master.shape or mine.layout.specs != theirs.layout.specs:
                raise ValueError(f"EMA group {mine.name!r} does not match the actor's layout")
            mine.master.mul_(beta).add_(theirs.master, alpha=1.0 - beta)
            mine.write_shard()

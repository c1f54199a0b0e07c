"""Engines of the RLHF steps: DeepSpeed configs from step settings, engines of each step-3 role, global sums.

Roles (DeepSpeed-Chat's step 3): the **actor** (trained; ZeRO stage and hybrid engine from the settings), the
**reference** (the initial actor, inference only: no optimizer state at all), the **critic** (trained; initialised
from the reward model), the **reward model** (inference only) and an optional **EMA** copy of the actor (inference
only, moved by :meth:`Engine.ema_update_from` shard by shard from the actor's fp32 master: no communication).

The optimizer and scheduler built here (:func:`ds_config`, :func:`scheduler_block`, :func:`hf_scheduler`,
:func:`decay_groups`) are the only place the RLHF steps turn settings into an optimizer and a schedule; the settings'
own bounds are in :mod:`hybridzero.rlhf.settings`. As in DeepSpeed-Chat: AdamW with betas (0.9, 0.95); weight decay
on every trained parameter except biases and norm weights (``get_optimizer_grouped_parameters``'s name list); the
six ``lr_scheduler_type`` choices are ``transformers.get_scheduler``'s curves over the run's optimizer steps, handed
to the engine as a client scheduler (``warmup_cosine`` is DeepSpeed's ``WarmupCosineLR`` block).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import transformers
from torch import nn

import hybridzero
from hybridzero.checkpoint.hf_source import HFCheckpointSource
from hybridzero.comm.collectives import Comm, init_distributed
from hybridzero.comm.ledger import Ledger
from hybridzero.rlhf.lora import LoRASpec, apply_lora, lora_source
from hybridzero.rlhf.models import ValueHeadModel, dropout_overrides, load_value_model
from hybridzero.rlhf.settings import HF_SCHEDULES, GRPOSettings, PPOSettings
from hybridzero.runtime.engine import Engine
from hybridzero.runtime.pretrained import check_model_matches, meta_model

__all__ = [
    "NO_DECAY_NAMES",
    "OptimSpec",
    "Roles",
    "build_engine",
    "build_roles",
    "data_sum",
    "decay_groups",
    "ds_config",
    "engine_numel",
    "global_sum",
    "hf_scheduler",
    "load_actor_engine",
    "scheduler_block",
    "world_comm",
]

# DeepSpeed-Chat's get_optimizer_grouped_parameters: parameters whose lower-cased name contains one of these get no
# weight decay
NO_DECAY_NAMES: tuple[str, ...] = ("bias", "layer_norm.weight", "layernorm.weight", "norm.weight", "ln_f.weight")


@dataclass(frozen=True)
class OptimSpec:
    """One trained engine's optimizer and schedule."""

    lr: float
    weight_decay: float
    schedule: str  # one of HF_SCHEDULES (transformers.get_scheduler) or "warmup_cosine" (DeepSpeed block)
    warmup_steps: int
    total_steps: int


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]] | None:
    """Torch param groups ``[decayed, not decayed]`` split by :data:`NO_DECAY_NAMES` (empty groups left out), or
    ``None`` when ``weight_decay`` is 0 (one group: the same update, and the same shard layout as before)."""
    if weight_decay == 0.0:
        return None
    decay: list[nn.Parameter] = []
    plain: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (plain if any(key in name.lower() for key in NO_DECAY_NAMES) else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def hf_scheduler(spec: OptimSpec) -> Callable[[torch.optim.Optimizer], Any] | None:
    """A client scheduler factory for the engine: ``transformers.get_scheduler(schedule, ...)`` over
    ``total_steps`` optimizer steps; ``None`` for ``warmup_cosine`` (the DeepSpeed block does it)."""
    if spec.schedule not in HF_SCHEDULES:
        return None

    def make(optimizer: torch.optim.Optimizer) -> Any:
        return transformers.get_scheduler(
            spec.schedule, optimizer, num_warmup_steps=spec.warmup_steps, num_training_steps=max(spec.total_steps, 1)
        )

    return make


def scheduler_block(spec: OptimSpec) -> dict[str, Any]:
    """The DeepSpeed ``scheduler`` block of ``spec``: linear warmup from 0 (HF ``get_scheduler``'s shape), or none
    at all (``warmup_steps == 0``: the first step already runs at ``lr``); cosine decays to 10% of ``lr``."""
    warmup = min(spec.warmup_steps, max(spec.total_steps - 1, 0))
    floor = 0.0 if warmup else 1.0  # without warmup the "warmup start" is the peak itself
    common = {"warmup_num_steps": max(warmup, 1), "warmup_type": "linear"}
    if spec.schedule == "constant":
        return {"type": "WarmupLR", "params": {"warmup_min_lr": spec.lr * floor, "warmup_max_lr": spec.lr, **common}}
    if spec.schedule == "linear":
        return {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": spec.lr * floor,
                "warmup_max_lr": spec.lr,
                "total_num_steps": max(spec.total_steps, warmup + 1, 2),
                **common,
            },
        }
    return {
        "type": "WarmupCosineLR",
        "params": {
            "total_num_steps": max(spec.total_steps, warmup + 1, 3),
            "warmup_min_ratio": floor,
            "cos_min_ratio": 0.1,
            **common,
        },
    }


def offload_blocks(stage: int) -> dict[str, Any]:
    """DeepSpeed-Chat's ``--offload*`` as ``zero_optimization`` keys: the fp32 master (and optimizer state) on the
    host, and at stage 3 the parameter shards too (hybridzero casts compute shards from the host master)."""
    blocks: dict[str, Any] = {"offload_optimizer": {"device": "cpu"}}
    if stage == 3:
        blocks["offload_param"] = {"device": "cpu"}
    return blocks


def ds_config(
    *,
    stage: int,
    dtype: str,
    micro_batch: int,
    world_size: int,
    grad_accum: int = 1,
    optim: OptimSpec | None = None,
    clipping: float = 1.0,
    offload: bool = False,
) -> dict[str, Any]:
    """A DeepSpeed JSON config for one engine; ``optim=None`` builds an inference-only engine; ``offload`` adds
    :func:`offload_blocks`. Every RLHF engine skips a step whose gradients hold inf/nan on any rank, also in
    fp32/bf16 (``skip_nonfinite_steps``; counted in the ``skipped_steps`` metric), so one bad batch can never turn
    the weights into NaN. No ``hybrid_engine`` block: ``engine.generate`` needs none (the rollout chooses it); the
    actor gets one from :func:`build_roles` with ``--enable_hybrid_engine`` (its ``--inference_tp_size``)."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": micro_batch * grad_accum * world_size,
        "zero_optimization": {"stage": stage, **(offload_blocks(stage) if offload else {})},
        "steps_per_print": 10**9,
        "skip_nonfinite_steps": True,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 16, "loss_scale_window": 100, "hysteresis": 2}
    if optim is not None:
        cfg["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": optim.lr, "weight_decay": optim.weight_decay, "betas": [0.9, 0.95], "eps": 1e-8},
        }
        if optim.schedule not in HF_SCHEDULES:
            cfg["scheduler"] = scheduler_block(optim)
        cfg["gradient_clipping"] = clipping
    return cfg


def _client_optim(
    model: nn.Module, optim: OptimSpec | None, lora_groups: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """``initialize`` keyword arguments: the parameter groups (LoRA's, adapters at their own lr, when LoRA is on;
    else the weight-decay groups of ``optim``) and the HF scheduler factory of ``optim``."""
    kwargs: dict[str, Any] = {}
    if lora_groups is not None:
        kwargs["model_parameters"] = lora_groups
    elif optim is not None:
        kwargs["model_parameters"] = decay_groups(model, optim.weight_decay)
    if optim is not None:
        kwargs["lr_scheduler"] = hf_scheduler(optim)
    return kwargs


def build_engine(
    model: nn.Module,
    config: dict[str, Any],
    *,
    checkpointing: bool = False,
    optim: OptimSpec | None = None,
    lora: LoRASpec | None = None,
) -> Engine:
    """``hybridzero.initialize`` on ``model`` (LoRA adapters added and activation checkpointing enabled first when
    asked); ``optim`` (the spec ``config``'s optimizer was built from) adds the decay groups and the scheduler."""
    groups = _lora_groups(model, config, lora)
    if checkpointing:
        if isinstance(model, ValueHeadModel):
            model.gradient_checkpointing_enable()
        else:
            cast(Any, model).gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, *_ = hybridzero.initialize(model=model, config=config, **_client_optim(model, optim, groups))
    return engine


def _lora_groups(model: nn.Module, config: dict[str, Any], lora: LoRASpec | None) -> list[dict[str, Any]] | None:
    """Apply ``lora`` to ``model``; the optimizer groups (adapters at their own lr) or None (LoRA off). Without an
    optimizer block (inference engines) the groups still fix the layout, which must match the trained copy's."""
    if lora is None or not lora.enabled:
        return None
    params = (config.get("optimizer") or {}).get("params", {})
    return apply_lora(model, lora, float(params.get("lr", lora.learning_rate)), float(params.get("weight_decay", 0.0)))


def load_actor_engine(
    path: str, cfg: dict[str, Any], checkpointing: bool, optim: OptimSpec | None = None, lora: LoRASpec | None = None
) -> Engine:
    """A causal-LM engine read straight into shards from the HF directory ``path`` (dropout forced to 0); with
    ``lora`` the adapters are added on the meta model and read from their seeded initial values."""
    model = meta_model(path, **dropout_overrides(transformers.AutoConfig.from_pretrained(path)))
    groups = _lora_groups(model, cfg, lora)
    if checkpointing:
        cast(Any, model).gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with HFCheckpointSource(path) as source:
        source = lora_source(model, lora or LoRASpec(), source)
        check_model_matches(source, model)  # a missing, transposed or oversized tensor is an error naming it
        engine, *_ = hybridzero.initialize(
            model=model, config=cfg, checkpoint_source=source, **_client_optim(model, optim, groups)
        )
    return engine


def step3_lora(s: PPOSettings) -> tuple[LoRASpec, LoRASpec]:
    """The actor's and the critic's LoRA settings from DS-Chat's step-3 flags."""
    actor = LoRASpec(
        s.actor_lora_dim, s.actor_lora_module_name, s.only_optimize_lora, s.actor_lora_learning_rate, s.seed
    )
    critic = LoRASpec(
        s.critic_lora_dim, s.critic_lora_module_name, s.only_optimize_lora, s.critic_lora_learning_rate, s.seed
    )
    return actor, critic


@dataclass(frozen=True)
class Roles:
    """The step-3 engines; ``critic`` is ``None`` for GRPO, ``reward`` for GRPO without a reward model, ``ema`` when
    the EMA actor is off."""

    actor: Engine
    ref: Engine
    reward: Engine | None  # None: GRPO scored by reward functions only
    critic: Engine | None = None
    ema: Engine | None = None

    def trained(self) -> dict[str, Engine]:
        """The roles that change during training and are checkpointed: actor, critic, EMA (those present)."""
        named = {"actor": self.actor, "critic": self.critic, "ema": self.ema}
        return {name: engine for name, engine in named.items() if engine is not None}


def build_roles(s: PPOSettings, world: int, total_steps: int, with_reward_model: bool = True) -> Roles:
    """The engines of PPO or GRPO (no critic), with the EMA actor when enabled and the reward model when
    ``with_reward_model``."""
    gen, train = s.per_device_generation_batch_size, s.per_device_training_batch_size
    updates = max(
        total_steps * s.ppo_epochs * s.generation_batches * (gen // train) // s.gradient_accumulation_steps, 1
    )

    def spec(lr: float, wd: float) -> OptimSpec:
        return OptimSpec(lr, wd, s.lr_scheduler_type, s.num_warmup_steps, updates)

    def trained(stage: int, optim: OptimSpec) -> dict[str, Any]:
        return ds_config(
            stage=stage,
            dtype=s.dtype,
            micro_batch=train,
            world_size=world,
            grad_accum=s.gradient_accumulation_steps,
            optim=optim,
            clipping=s.gradient_clipping,
            offload=s.offload,
        )

    def frozen(stage: int, offload: bool) -> dict[str, Any]:
        return ds_config(stage=stage, dtype=s.dtype, micro_batch=train, world_size=world, offload=offload)

    actor_lora, critic_lora = step3_lora(s)
    actor_optim = spec(s.actor_learning_rate, s.actor_weight_decay)
    actor_cfg = trained(s.actor_zero_stage, actor_optim)
    if s.enable_hybrid_engine:  # DS-Chat's hybrid engine block; inference_tp_size > 1: tensor-parallel generation
        actor_cfg["hybrid_engine"] = {
            "inference_tp_size": s.inference_tp_size,
            "tp_gather_partition_size": s.tp_gather_partition_size,
        }
    if s.rollout_engine != "hf":  # recorded in the actor's config (hybrid_engine.rollout_engine; validated there)
        actor_cfg.setdefault("hybrid_engine", {})["rollout_engine"] = s.rollout_engine
    if s.enable_mixed_precision_lora and actor_lora.enabled:
        actor_cfg["zero_optimization"]["zero_quantized_nontrainable_weights"] = True  # DS-Chat's meaning
    ref_cfg = frozen(s.stage_of("reference"), s.offload_reference_model)
    sp = s.sequence_parallel_size  # the engines check it divides the world and the heads (one line)
    if sp > 1:  # the actor's and the reference's forwards split by sequence; they count data-parallel ranks
        for cfg, accum in ((actor_cfg, s.gradient_accumulation_steps), (ref_cfg, 1)):
            cfg["sequence_parallel_size"] = sp
            cfg["train_batch_size"] = train * accum * max(world // sp, 1)
    actor = load_actor_engine(
        s.actor_model_name_or_path, actor_cfg, s.actor_gradient_checkpointing, actor_optim, actor_lora
    )
    ref = load_actor_engine(s.actor_model_name_or_path, ref_cfg, False)
    ema = None  # the EMA copy has the actor's adapters and the same group membership, so the same layout
    if s.enable_ema:
        ema_cfg = frozen(s.actor_zero_stage, s.offload_reference_model)
        if sp > 1:  # forwarded split like the actor; shards stay over the whole world, so the layout is the actor's
            ema_cfg["sequence_parallel_size"] = sp
            ema_cfg["train_batch_size"] = train * max(world // sp, 1)
        ema = load_actor_engine(s.actor_model_name_or_path, ema_cfg, False, lora=actor_lora)
    reward = None
    if with_reward_model:
        reward_cfg = frozen(s.stage_of("reward"), s.offload_reward_model)
        if sp > 1:  # scores from split forwards (rlhf.rollout.sp_values), the SP group's rows summed back
            reward_cfg["sequence_parallel_size"] = sp
            reward_cfg["train_batch_size"] = train * max(world // sp, 1)
        reward = build_engine(load_value_model(s.critic_model_name_or_path, no_dropout=True).float(), reward_cfg)
    critic = None
    if not isinstance(s, GRPOSettings):
        critic_optim = spec(s.critic_learning_rate, s.critic_weight_decay)
        critic_cfg = trained(s.critic_zero_stage, critic_optim)
        if sp > 1:  # per-token values from split forwards (rlhf.rollout.sp_values), as the actor's log-probs
            critic_cfg["sequence_parallel_size"] = sp
            critic_cfg["train_batch_size"] = train * s.gradient_accumulation_steps * max(world // sp, 1)
        critic = build_engine(
            load_value_model(s.critic_model_name_or_path, no_dropout=True).float(),
            critic_cfg,
            checkpointing=s.critic_gradient_checkpointing,
            optim=critic_optim,
            lora=critic_lora,
        )
    for frozen_engine in (ref, reward, ema):  # inference only: no optimizer state; scored under no_grad
        if frozen_engine is not None:
            frozen_engine.eval()
    return Roles(actor=actor, ref=ref, reward=reward, critic=critic, ema=ema)


def global_sum(engine: Engine, values: Sequence[float] | torch.Tensor) -> list[float]:
    """Sum ``values`` over ranks (one float64 all-reduce through the engine's counted comm)."""
    t = torch.as_tensor(values, dtype=torch.float64).reshape(-1).clone().to(engine.device)
    engine.comm.all_reduce(t, phase="metrics")
    return [float(v) for v in t.cpu()]


def data_sum(engine: Engine, values: Sequence[float]) -> list[float]:
    """:func:`global_sum` over the data: under sequence parallelism the ``s`` ranks of an SP group hold the same
    rows, so only SP rank 0 of each group contributes (the same sums as the ``s = 1`` run, on every rank)."""
    sp = engine.sequence_parallel
    weight = 1.0 if sp is None or sp.rank == 0 else 0.0
    return global_sum(engine, [weight * float(v) for v in values])


def engine_numel(engine: Engine) -> int:
    """The full (unsharded) parameter count of an engine's model, tied weights once."""
    return sum(slot.spec.numel for group in engine.groups for slot in group.slots)


def world_comm() -> Comm:
    """This process's view of the world (``rank``, ``world_size``) after :func:`init_distributed`: the RLHF steps
    read ranks through ``hybridzero.comm``, never ``torch.distributed``."""
    init_distributed()
    return Comm(Ledger(), name="rlhf")

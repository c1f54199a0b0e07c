"""Step 3 setup: the engines of each role, the prompt set, and how prompts are dealt to ranks and samples.

Dealing (what makes world sizes comparable): an iteration consumes ``generation_batches`` global generation
batches of ``P_g = per_device_generation_batch_size / k x W`` prompts (``k`` = samples per prompt: 1 for PPO,
``group_size`` for GRPO) from a seeded per-epoch order. A global batch is cut into training chunks of
``u x W`` prompts (``u = per_device_training_batch_size / k``) and rank ``r`` takes slice ``r`` of every chunk; so
the ``j``-th training mini-batch of every rank is slice ``r`` of global chunk ``j``, and the union over ranks is the
same set of samples at every world size. Sample ``j`` of the prompt at epoch position ``q`` has the id
``(epoch x n_prompts + q) x k + j`` (its sampling seed; see :mod:`hybridzero.rlhf.sampling`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hybridzero.rlhf.common import phase_records
from hybridzero.rlhf.data import check_budget
from hybridzero.rlhf.engines import (
    OptimSpec,
    build_engine,
    dropout_overrides,
    ds_config,
)
from hybridzero.rlhf.models import load_value_model
from hybridzero.rlhf.ppo import Roles
from hybridzero.rlhf.settings import GRPOSettings, PPOSettings

__all__ = ["Plan", "build_roles", "load_actor_engine", "load_prompts", "make_plan", "model_context", "prompt_tensors",
           "rank_prompts"]


@dataclass(frozen=True)
class Plan:
    """Iteration arithmetic of a step-3 run (per rank unless named global)."""

    world: int
    k: int  # samples per prompt
    prompts_per_gen_batch: int  # per rank
    prompts_per_train_batch: int  # per rank (u)
    global_prompts_per_iteration: int
    iterations_per_epoch: int
    total_iterations: int
    n_prompts: int


def make_plan(s: PPOSettings, world: int, n_prompts: int) -> Plan:
    """The run's :class:`Plan`; raises naming the sizes when the prompts cannot fill one iteration."""
    k = s.group_size if isinstance(s, GRPOSettings) else 1
    per_gen = s.per_device_generation_batch_size // k
    per_iter = per_gen * world * s.generation_batches
    if n_prompts < per_iter:
        raise ValueError(f"step 3 has {n_prompts} usable prompt(s) but one iteration needs {per_iter} "
                         f"(per_device_generation_batch_size {s.per_device_generation_batch_size} / {k} sample(s) "
                         f"per prompt x world {world} x generation_batches {s.generation_batches})")
    per_epoch = n_prompts // per_iter
    total = per_epoch * s.num_train_epochs
    if s.max_steps is not None:
        total = min(total, s.max_steps)
    return Plan(world, k, per_gen, s.per_device_training_batch_size // k, per_iter, per_epoch, total, n_prompts)


def rank_prompts(order: list[int], plan: Plan, iteration_in_epoch: int, batch: int, rank: int) -> list[int]:
    """Epoch positions of rank ``rank``'s prompts in generation batch ``batch`` of an iteration (module doc)."""
    size = plan.prompts_per_gen_batch * plan.world
    start = (iteration_in_epoch * (plan.global_prompts_per_iteration // size) + batch) * size
    chunk, u = plan.prompts_per_train_batch * plan.world, plan.prompts_per_train_batch
    out: list[int] = []
    for c in range(start, start + size, chunk):
        out += list(range(c + rank * u, c + (rank + 1) * u))
    return out


def load_prompts(s: PPOSettings, tok: Any, model_context: int) -> tuple[list[str], dict[str, int]]:
    """The phase-3 prompts within ``max_prompt_seq_len`` tokens (``prompt_policy`` drop or truncate, counted)."""
    check_budget(model_context, s.max_prompt_seq_len, s.max_answer_seq_len)
    records = phase_records(s.data_path, s.data_split, 3, ("prompt",), s.seed)
    prompts, counts = [], {"dropped": 0, "truncated": 0, "empty": 0}
    for r in records:
        ids = tok.encode(r["prompt"], add_special_tokens=False)
        if not ids:
            counts["empty"] += 1
            continue
        if len(ids) > s.max_prompt_seq_len:
            if s.prompt_policy == "drop":
                counts["dropped"] += 1
                continue
            counts["truncated"] += 1
            r = {**r, "prompt": tok.decode(ids[-s.max_prompt_seq_len:])}
        prompts.append(r["prompt"])
    if not prompts:
        raise ValueError(f"no usable step-3 prompts: {counts} (max_prompt_seq_len {s.max_prompt_seq_len})")
    return prompts, counts


def load_actor_engine(path: str, cfg: dict[str, Any], checkpointing: bool) -> Any:
    """A causal-LM engine read straight into shards from the HF directory ``path`` (dropout forced to 0)."""
    import transformers

    import hybridzero
    from hybridzero.checkpoint.hf_source import HFCheckpointSource
    from hybridzero.runtime.pretrained import meta_model

    model = meta_model(path, **dropout_overrides(transformers.AutoConfig.from_pretrained(path)))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with HFCheckpointSource(path) as source:
        engine, *_ = hybridzero.initialize(model=model, config=cfg, checkpoint_source=source)
    return engine


def build_roles(s: PPOSettings, world: int, total_steps: int) -> Roles:
    """The engines of PPO or GRPO (no critic), with the EMA actor when enabled."""
    gen, train = s.per_device_generation_batch_size, s.per_device_training_batch_size
    updates = max(total_steps * s.ppo_epochs * s.generation_batches * (gen // train)
                  // s.gradient_accumulation_steps, 1)

    def trained(stage: int, lr: float, wd: float, hybrid: bool = False) -> dict[str, Any]:
        optim = OptimSpec(lr, wd, s.lr_scheduler_type, s.num_warmup_steps, updates)
        return ds_config(stage=stage, dtype=s.dtype, micro_batch=train, world_size=world,
                         grad_accum=s.gradient_accumulation_steps, optim=optim, clipping=s.gradient_clipping,
                         hybrid=hybrid)

    def frozen(stage: int) -> dict[str, Any]:
        return ds_config(stage=stage, dtype=s.dtype, micro_batch=train, world_size=world)

    actor = load_actor_engine(s.actor_model_name_or_path,
                        trained(s.actor_zero_stage, s.actor_learning_rate, s.actor_weight_decay,
                                s.enable_hybrid_engine), s.actor_gradient_checkpointing)
    ref = load_actor_engine(s.actor_model_name_or_path, frozen(s.reference_zero_stage), False)
    ema = load_actor_engine(s.actor_model_name_or_path, frozen(s.actor_zero_stage), False) if s.enable_ema else None
    reward = build_engine(load_value_model(s.critic_model_name_or_path).float(), frozen(s.reward_zero_stage))
    critic = None
    if not isinstance(s, GRPOSettings):
        critic = build_engine(load_value_model(s.critic_model_name_or_path).float(),
                              trained(s.critic_zero_stage, s.critic_learning_rate, s.critic_weight_decay),
                              checkpointing=s.critic_gradient_checkpointing)
    for frozen_engine in (ref, reward, ema):  # inference only: no optimizer state; scored under no_grad
        if frozen_engine is not None:
            frozen_engine.eval()
    return Roles(actor=actor, ref=ref, reward=reward, critic=critic, ema=ema)


def model_context(hf_config: Any) -> int:
    """The model's context length (``max_position_embeddings`` or GPT-2's ``n_positions``)."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"cannot tell the context length of {type(hf_config).__name__}: no max_position_embeddings")


def prompt_tensors(tok: Any, prompts: list[str], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``(input_ids, attention_mask)`` of already budget-checked prompts."""
    from hybridzero.rlhf.data import pad_sequences

    rows = [tok.encode(p, add_special_tokens=False) for p in prompts]
    ids = pad_sequences(rows, pad_id, left=True)
    mask = pad_sequences([[1] * len(r) for r in rows], 0, left=True)
    return ids, mask

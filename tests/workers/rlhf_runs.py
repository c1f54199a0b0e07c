"""RLHF pipeline runs for the tests: tiny model directories and worker-side entry points.

:func:`make_model_dirs` writes (in the test process, no process group) an actor directory (the demo's tiny Llama,
seeded, with the demo tokenizer) and a value-model directory (same config, its own seed), so step-3 tests start
from fixed weights without training steps 1 and 2. The ``*_run`` functions are module-level (picklable) and run
on every rank of a :class:`~tests.harness.spawn.WorldPool`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["ema_run", "make_model_dirs", "reward_run", "sft_run", "step3_run", "step_both_run"]


def make_model_dirs(root: Path, seed: int = 0, **config_overrides: Any) -> tuple[str, str]:
    """``(actor_dir, value_dir)`` of the demo's tiny Llama (fp32, seeded) under ``root``."""
    import transformers

    from hybridzero.rlhf.data.demo_task import build_tokenizer, demo_model_config
    from hybridzero.rlhf.models import ValueHeadModel, write_value_model

    tok = build_tokenizer()
    config = demo_model_config(tok)
    for key, value in config_overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    actor = transformers.AutoModelForCausalLM.from_config(config)
    actor_dir, value_dir = root / "actor", root / "value"
    actor.save_pretrained(actor_dir)
    tok.save_pretrained(actor_dir)
    torch.manual_seed(seed + 1)
    write_value_model(ValueHeadModel(config, head_seed=seed + 2), value_dir, tok)
    return str(actor_dir), str(value_dir)


# the values these tests were written against (the settings' defaults are now DeepSpeed-Chat's: fp16, stage 0,
# Dahoas/rm-static, TensorBoard off); a test's own settings override them
HARNESS_DEFAULTS: dict[str, Any] = {
    "data_path": ["demo"],
    "dtype": "fp32",
    "enable_tensorboard": True,
    "lr_scheduler_type": "warmup_cosine",
}
STEP3_DEFAULTS: dict[str, Any] = {
    **HARNESS_DEFAULTS,
    "actor_zero_stage": 3,
    "critic_zero_stage": 3,
    "reference_zero_stage": 3,
    "reward_zero_stage": 3,
    "num_warmup_steps": 0,
}
STEP12_DEFAULTS: dict[str, Any] = {**HARNESS_DEFAULTS, "zero_stage": 3}


def step3_run(settings: dict[str, Any], grpo: bool = False, fail_at: int | None = None) -> dict[str, Any]:
    """One rank of a step-3 run; ``fail_at`` raises (on every rank) inside that iteration's metrics, after the
    rollout, as a crash would. Returns the history and the final models' paths."""
    from hybridzero.rlhf.settings import GRPOSettings, PPOSettings
    from hybridzero.rlhf.steps.rl.trainer import train_step3

    calls = {"n": 0}

    def monitor(prompts: list[str], answers: list[str]) -> dict[str, float]:
        calls["n"] += 1
        if fail_at is not None and calls["n"] >= fail_at:
            raise RuntimeError(f"injected crash at monitor call {calls['n']}")
        return {"answers_nonempty": float(sum(bool(a.strip()) for a in answers))}

    model = GRPOSettings if grpo else PPOSettings
    result = train_step3(model(**{**STEP3_DEFAULTS, **settings}), monitor=monitor)
    return {
        "history": result["history"],
        "models": result["models"],
        "start": result["start"],
        "world": torch.distributed.get_world_size(),
    }


def sft_run(settings: dict[str, Any]) -> dict[str, Any]:
    """One rank of step 1."""
    from hybridzero.rlhf.settings import SFTSettings
    from hybridzero.rlhf.steps.sft import train_sft

    return train_sft(SFTSettings(**{**STEP12_DEFAULTS, **settings}))


def reward_run(settings: dict[str, Any]) -> dict[str, Any]:
    """One rank of step 2."""
    from hybridzero.rlhf.settings import RewardSettings
    from hybridzero.rlhf.steps.reward_model import train_reward

    return train_reward(RewardSettings(**{**STEP12_DEFAULTS, "learning_rate": 1e-3, **settings}))


def step_both_run(actor_dir: str, value_dir: str, overflow_in: str) -> dict[str, Any]:
    """fp16 actor and critic engines; the last rank puts an inf into ``overflow_in``'s gradient shard (none for
    another name);
    ``step_both`` must skip both. Returns parameter changes, loss scales and applied flags."""
    import hybridzero
    from hybridzero.rlhf.engines import OptimSpec, build_engine, ds_config, load_actor_engine
    from hybridzero.rlhf.models import load_value_model
    from hybridzero.rlhf.steps.rl.step3 import step_both

    hybridzero.init_distributed()
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    optim = OptimSpec(1e-3, 0.0, "constant", 0, 10)
    cfg = ds_config(stage=3, dtype="fp16", micro_batch=2, world_size=world, optim=optim)
    engines = {
        "actor": load_actor_engine(actor_dir, cfg, False),
        "critic": build_engine(load_value_model(value_dir).float(), cfg),
    }
    before = {n: e.full_parameters() for n, e in engines.items()}
    scales = {n: e.loss_scale for n, e in engines.items()}
    ids = torch.tensor([[4, 5, 6, 7], [8, 9, 10, 11]])
    # small losses: at the initial scale 2^16 a unit loss overflows fp16 gradients by itself
    engines["actor"].backward(engines["actor"](input_ids=ids).logits.float().mean() * 1e-3)
    engines["critic"].backward(engines["critic"](input_ids=ids).mean() * 1e-3)
    if rank == world - 1 and overflow_in in engines:
        engines[overflow_in].groups[0].grad_shard[0] = float("inf")
    skipped = step_both(engines["actor"], engines["critic"])
    after = {n: e.full_parameters() for n, e in engines.items()}
    changed = {n: any(not torch.equal(before[n][k], after[n][k]) for k in before[n]) for n in engines}
    return {
        "skipped": skipped,
        "changed": changed,
        "scales_before": scales,
        "scales_after": {n: e.loss_scale for n, e in engines.items()},
        "applied": {n: e.was_step_applied() for n, e in engines.items()},
    }


def ema_run(actor_dir: str, beta: float) -> dict[str, Any]:
    """``Engine.ema_update_from`` between two ZeRO-3 engines of the same model, the source moved first; and the
    refusal of a source with another layout (stage 0: whole masters). Returns full parameters and the error."""
    import hybridzero
    from hybridzero.rlhf.engines import OptimSpec, ds_config, load_actor_engine

    hybridzero.init_distributed()
    world = torch.distributed.get_world_size()
    frozen = ds_config(stage=3, dtype="fp32", micro_batch=1, world_size=world)
    ema, actor = (
        load_actor_engine(actor_dir, frozen, False),
        load_actor_engine(
            actor_dir,
            ds_config(
                stage=3, dtype="fp32", micro_batch=1, world_size=world, optim=OptimSpec(1e-2, 0.0, "constant", 0, 1)
            ),
            False,
        ),
    )
    actor.backward(actor(input_ids=torch.tensor([[4, 5, 6, 7]])).logits.float().pow(2).mean())
    actor.step()
    before = ema.full_parameters()
    ema.ema_update_from(actor, beta)
    after = ema.full_parameters()
    other = load_actor_engine(actor_dir, ds_config(stage=0, dtype="fp32", micro_batch=1, world_size=world), False)
    try:
        ema.ema_update_from(other, beta)
        error = None
    except ValueError as exc:
        error = str(exc)
    kept = ema.full_parameters()
    return {
        "before": before,
        "source": actor.full_parameters(),
        "after": after,
        "error": error,
        "unchanged_after_error": all(torch.equal(kept[k], v) for k, v in after.items()),
    }

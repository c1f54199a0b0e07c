"""Step 3's outer loop (DeepSpeed-Chat's ``main.py`` of step 3): set up, resume, iterate, report, save, finish.

The iteration itself is the algorithm's: :func:`~hybridzero.rlhf.steps.rl.ppo.ppo_iteration` for :class:`PPOSettings`,
:func:`~hybridzero.rlhf.steps.rl.grpo.grpo_iteration` for :class:`GRPOSettings`. Checkpoints of the trained roles
(actor,
critic, EMA) go to ``output_dir/checkpoints`` every ``save_interval`` iterations and at the end; a run started with
``resume`` continues from the newest iteration every role saved completely
(:mod:`hybridzero.rlhf.steps.rl.checkpoints`) —
sampling depends only on sample ids and data orders only on seeds, so the resumed run continues the same curve.
Final models: ``output_dir/actor`` (HF directory), ``output_dir/critic`` (value model), ``output_dir/actor_ema``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from hybridzero.rlhf.engines import engine_numel
from hybridzero.rlhf.models import save_causal_lm, save_value_model
from hybridzero.rlhf.rewards.functions import RewardFunction
from hybridzero.rlhf.runlog.metrics import open_runlog
from hybridzero.rlhf.runlog.report import ModelShape, Reporter, Step3Timing, model_shape
from hybridzero.rlhf.settings import GRPOSettings, PPOSettings
from hybridzero.rlhf.steps.rl.checkpoints import RoleCheckpoints
from hybridzero.rlhf.steps.rl.grpo import grpo_iteration
from hybridzero.rlhf.steps.rl.ppo import ppo_iteration
from hybridzero.rlhf.steps.rl.step3 import Monitor, Step3

__all__ = ["Monitor", "train_step3"]

_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def timing_template(run: Step3) -> Step3Timing:
    """The run's constant report numbers (per-rank batch, lengths, world, dtype, ptx rows) with zero times."""
    s = run.s
    ptx_rows = s.per_device_training_batch_size * run.updates_per_iteration if run.ptx is not None else 0
    return Step3Timing(
        e2e_s=0.0,
        generation_s=0.0,
        training_s=0.0,
        batch_size=s.per_device_generation_batch_size * s.generation_batches,
        prompt_len=s.max_prompt_seq_len,
        answer_len=s.max_answer_seq_len,
        world_size=run.world,
        gradient_checkpointing=s.actor_gradient_checkpointing,
        dtype_bytes=_BYTES[s.dtype],
        unsup_batch_size=ptx_rows,
        generation_batches=s.generation_batches,
        ppo_epochs=s.ppo_epochs,
        sequence_parallel=run.sp_size,
    )


def _shapes(run: Step3) -> tuple[ModelShape, ModelShape | None]:
    actor = model_shape(run.hf_config, engine_numel(run.roles.actor))
    critic = run.roles.critic
    return actor, (model_shape(critic.module.config, engine_numel(critic)) if critic is not None else None)


def _finish(run: Step3) -> dict[str, str]:
    """Write the final models (every rank calls; rank 0 writes); returns their directories."""
    out, roles = Path(run.s.output_dir), run.roles
    paths = {"actor": save_causal_lm(roles.actor, out / "actor", run.hf_config, run.tok)}
    if roles.critic is not None:
        paths["critic"] = save_value_model(roles.critic, out / "critic", run.tok)
    if roles.ema is not None:
        paths["actor_ema"] = save_causal_lm(roles.ema, out / "actor_ema", run.hf_config, run.tok)
    return {k: str(v) for k, v in paths.items()}


def _loop(
    run: Step3, name: str, iteration: Callable[[Step3, int], dict[str, float]]
) -> tuple[list[dict[str, float]], dict[str, str], int]:
    """Resume, iterate, report, save, write the final models; returns ``(history, models, start)``."""
    s = run.s
    log = open_runlog(s.output_dir, run.rank, s.enable_tensorboard, s.progress, run.roles.actor.monitor)
    reporter = Reporter(log, name, *_shapes(run), timing_template(run), s.print_every)
    total = run.plan.total_iterations
    sp = f" (sequence_parallel_size {run.sp_size})" if run.sp_size > 1 else ""
    log.print(
        f"{name.upper()}: {len(run.prompts)} prompts (prompt filter {run.prompt_counts}), {total} iterations "
        f"at world {run.world}{sp}, hybrid engine {'on' if s.enable_hybrid_engine else 'off'}"
    )
    checkpoints = RoleCheckpoints(Path(s.output_dir) / "checkpoints", run.roles.trained())
    start = checkpoints.resume(log.print) if s.resume else 0
    if run.ptx is not None:  # the ptx stream is a function of batches drawn: re-position it
        run.ptx.skip(start * s.ppo_epochs * run.updates_per_iteration)
    history: list[dict[str, float]] = []
    bar = tqdm(total=total, initial=start, desc=name, disable=not (s.progress and run.rank == 0))
    for it in range(start, total):
        metrics = iteration(run, it)
        history.append(metrics)
        reporter.step(it + 1, total, metrics)
        if (s.save_interval and (it + 1) % s.save_interval == 0) or it + 1 == total:
            checkpoints.save(it + 1)
        bar.update(1)
    bar.close()
    models = _finish(run)
    log.print(f"{name.upper()}: final actor in {models['actor']}")
    log.close()
    return history, models, start


def train_step3(
    s: PPOSettings, monitor: Monitor | None = None, reward_funcs: Sequence[str | RewardFunction] | None = None
) -> dict[str, Any]:
    """Run step 3 (PPO, or GRPO for :class:`GRPOSettings`); returns ``{"history", "models", "start",
    "vllm_syncs"}`` (``vllm_syncs``: weight syncs into this rank's vLLM engine, ``None`` with rollout_engine hf).

    ``reward_funcs`` (GRPO only): reward functions as callables or ``module:function`` specs, instead of
    ``s.reward_funcs`` (TRL's signature: :mod:`hybridzero.rlhf.rewards.functions`); ``s.reward_weights`` weighs them."""
    grpo = isinstance(s, GRPOSettings)
    if reward_funcs and not grpo:
        raise ValueError("reward_funcs: reward functions need GRPOSettings (the grpo step); PPO scores with its critic")
    name = "grpo" if grpo else "ppo"
    iteration: Callable[[Step3, int], dict[str, float]] = grpo_iteration if grpo else ppo_iteration
    run = Step3(s, monitor, reward_funcs)
    try:
        history, models, start = _loop(run, name, iteration)
    finally:
        run.close()  # the reward worker ends with the run, by return or by exception
    syncs = run.vllm.stats.syncs if run.vllm is not None else None
    return {"history": history, "models": models, "start": start, "vllm_syncs": syncs}

"""The optimizer-step loop steps 1 and 2 share: epochs of seeded global batches, per-step global metrics,
periodic and per-epoch evaluation, logs, a progress bar.

A step consumes one global batch of ``micro x D x accumulation`` items (``D`` data-parallel ranks: the world
``W``, or ``W / s`` under sequence parallelism, whose ``s`` ranks share a slice); data rank ``r`` takes its
contiguous slice and runs ``accumulation`` micro-steps through ``micro_step(indices) -> local sums``;
``reduce(sums) -> metrics`` turns the summed local numbers into global means (one counted all-reduce). Evaluation
is collective too (every rank calls ``evaluate``), so every rank returns the same numbers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn
from tqdm import tqdm

from hybridzero.rlhf.data.dealing import epoch_order, rank_slice, steps_per_epoch
from hybridzero.rlhf.engines import OptimSpec, build_engine, ds_config, world_comm
from hybridzero.rlhf.lora import LoRASpec
from hybridzero.rlhf.models import ValueHeadModel
from hybridzero.rlhf.runlog.metrics import RunLog
from hybridzero.rlhf.settings import SupervisedSettings
from hybridzero.runtime.engine import Engine

__all__ = ["LoopSpec", "data_rank", "run_loop", "supervised_engine"]

Sums = dict[str, float]


@dataclass(frozen=True)
class LoopSpec:
    """What the loop needs from a step's settings and callbacks."""

    phase: str  # "sft" / "reward": metrics phase and progress-bar label
    n_items: int
    micro: int
    accumulation: int
    epochs: int
    total_steps: int
    seed: int
    eval_interval: int
    print_every: int
    progress: bool
    micro_step: Callable[[list[int]], Sums]
    reduce: Callable[[Sums], dict[str, float]]
    evaluate: Callable[[], dict[str, float]]
    step_line: Callable[[int, int, int, dict[str, float]], str]
    eval_line: Callable[[int, dict[str, float]], str]

    @classmethod
    def from_settings(
        cls, s: SupervisedSettings, *, phase: str, n_items: int, total_steps: int, **callbacks: Any
    ) -> LoopSpec:
        """The loop's sizes and cadence read from step 1/2 settings ``s``; ``callbacks`` are the five callables."""
        return cls(
            phase=phase,
            n_items=n_items,
            micro=s.per_device_train_batch_size,
            accumulation=s.gradient_accumulation_steps,
            epochs=s.num_train_epochs,
            total_steps=total_steps,
            seed=s.seed,
            eval_interval=s.eval_interval,
            print_every=s.print_every,
            progress=s.progress,
            **callbacks,
        )


def data_rank(engine: Engine) -> tuple[int, int]:
    """``(rank, size)`` of this rank in the batch dealing: its data-parallel rank and size (under sequence
    parallelism the ranks of one SP group share each micro-batch), else its world rank and size."""
    sp = engine.sequence_parallel
    return (sp.dp_rank, sp.dp_size) if sp is not None else (engine.comm.rank, engine.comm.world_size)


def supervised_engine(model: nn.Module, s: SupervisedSettings, n_train: int, what: str) -> tuple[Engine, int, int]:
    """``(engine, total_steps, global_batch)`` for step 1 or 2 settings ``s`` over ``n_train`` training items
    (``global_batch`` counts data-parallel ranks: the world over ``sequence_parallel_size``, a step 1 key)."""
    world = world_comm().world_size
    sp = int(getattr(s, "sequence_parallel_size", 1))
    global_batch = s.per_device_train_batch_size * max(world // sp, 1) * s.gradient_accumulation_steps
    total = steps_per_epoch(n_train, global_batch, what) * s.num_train_epochs
    if s.max_steps is not None:
        total = min(total, s.max_steps)
    optim = OptimSpec(s.learning_rate, s.weight_decay, s.lr_scheduler_type, s.num_warmup_steps, total)
    cfg = ds_config(
        stage=s.zero_stage,
        dtype=s.dtype,
        micro_batch=s.per_device_train_batch_size,
        world_size=world,
        grad_accum=s.gradient_accumulation_steps,
        optim=optim,
        clipping=s.gradient_clipping,
        offload=s.offload,  # DeepSpeed-Chat's --offload: ZeRO-Offload of the optimizer (and stage-3 parameters)
    )
    if sp > 1:  # the engine checks it divides the world and the heads (one line naming the key)
        cfg["sequence_parallel_size"] = sp
        cfg["train_batch_size"] = global_batch
    head = ("v_head",) if isinstance(model, ValueHeadModel) else ()  # step 2 trains its head (DS-Chat)
    lora = LoRASpec(s.lora_dim, s.lora_module_name, s.only_optimize_lora, s.lora_learning_rate, s.seed, head)
    engine = build_engine(model, cfg, checkpointing=s.gradient_checkpointing, optim=optim, lora=lora)
    return engine, total, global_batch


def _one_step(engine: Engine, spec: LoopSpec, mine: list[int]) -> dict[str, float]:
    """Accumulate ``spec.accumulation`` micro-steps; global metrics plus lr, step time and (``gradient_clipping``
    > 0, which computes it) the step's pre-clipping global gradient norm ``grad_norm``."""
    t0 = time.perf_counter()
    sums: Sums = {}
    for k in range(spec.accumulation):
        for key, value in spec.micro_step(mine[k * spec.micro : (k + 1) * spec.micro]).items():
            sums[key] = sums.get(key, 0.0) + value
    norm = engine.get_global_grad_norm()
    extra = {} if norm is None else {"grad_norm": float(norm)}
    return {**spec.reduce(sums), "lr": engine.get_lr()[0], **extra, "step_time_s": time.perf_counter() - t0}


def run_loop(engine: Engine, spec: LoopSpec, log: RunLog) -> dict[str, float]:
    """Train for ``spec.total_steps`` steps over at most ``spec.epochs`` epochs; returns the last metrics merged
    with the last evaluation."""
    rank, world = data_rank(engine)
    span = spec.micro * world * spec.accumulation
    bar = tqdm(total=spec.total_steps, desc=spec.phase, disable=not (spec.progress and engine.comm.rank == 0))
    step, metrics = 0, {}
    for epoch in range(spec.epochs):
        if step >= spec.total_steps:
            break
        order = epoch_order(spec.n_items, spec.seed, epoch)
        for start in range(0, len(order) - span + 1, span):
            if step >= spec.total_steps:
                break
            metrics = _one_step(engine, spec, rank_slice(order[start : start + span], rank, world))
            step += 1
            if spec.eval_interval and step % spec.eval_interval == 0:
                metrics.update(spec.evaluate())
            log.log(step, metrics, phase=spec.phase)
            if step % spec.print_every == 0 or step == spec.total_steps:
                log.print(spec.step_line(step, spec.total_steps, epoch, metrics))
            bar.update(1)
        ev = spec.evaluate()
        metrics.update(ev)
        log.log(step, ev, phase=f"{spec.phase}_eval")
        log.print(spec.eval_line(epoch, ev))
    bar.close()
    return metrics

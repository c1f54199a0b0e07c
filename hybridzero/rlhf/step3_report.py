"""What a step-3 run shows: per iteration a DeepSpeed-Chat-style report (latencies, samples/s, TFLOPs, bandwidth,
reward, losses, KL) every ``print_every`` iterations, and every metric and throughput number in ``metrics.jsonl``
and TensorBoard (tags ``ppo/<key>`` or ``grpo/<key>``). Timings are rank 0's; metrics are global means."""
from __future__ import annotations

from typing import Any

from hybridzero.rlhf.throughput import (
    ModelShape,
    Step3Timing,
    format_step3_lines,
    model_shape,
    step3_throughput,
)

__all__ = ["Reporter", "engine_numel"]

_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def engine_numel(engine: Any) -> int:
    """The full (unsharded) parameter count of an engine's model, tied weights once."""
    return sum(slot.spec.numel for group in engine.groups for slot in group.slots)


class Reporter:
    """Formats and logs one iteration (``run`` is the :class:`~hybridzero.rlhf.step3.Step3` state)."""

    def __init__(self, run: Any, log: Any) -> None:
        self.run, self.log = run, log
        roles = run.roles
        self.actor: ModelShape = model_shape(run.hf_config, engine_numel(roles.actor))
        self.critic: ModelShape | None = None
        if roles.critic is not None:
            self.critic = model_shape(roles.critic.module.config, engine_numel(roles.critic))
        self.phase = "grpo" if run.grpo else "ppo"

    def _timing(self, metrics: dict[str, float]) -> Step3Timing:
        s = self.run.s
        ptx_rows = s.per_device_training_batch_size if self.run.ptx is not None else 0
        updates = s.generation_batches * (s.per_device_generation_batch_size // s.per_device_training_batch_size)
        return Step3Timing(e2e_s=metrics["e2e_s"], generation_s=metrics["generation_s"],
                           training_s=metrics["training_s"],
                           batch_size=s.per_device_generation_batch_size * s.generation_batches,
                           prompt_len=s.max_prompt_seq_len, answer_len=s.max_answer_seq_len, world_size=self.run.world,
                           gradient_checkpointing=s.actor_gradient_checkpointing, dtype_bytes=_BYTES[s.dtype],
                           unsup_batch_size=ptx_rows * updates, generation_batches=s.generation_batches,
                           ppo_epochs=s.ppo_epochs)

    def step(self, step: int, total: int, metrics: dict[str, float]) -> dict[str, float]:
        """Log iteration ``step`` (1-based); print the report every ``print_every`` steps and at the last."""
        thr = step3_throughput(self.actor, self.critic, self._timing(metrics))
        numbers = {**metrics, **{k: v for k, v in thr.items() if k not in metrics}}
        self.log.log(step, numbers, phase=self.phase)
        if step % self.run.s.print_every == 0 or step == total:
            for line in format_step3_lines(step, total, thr, metrics):
                self.log.print(line)
        return numbers

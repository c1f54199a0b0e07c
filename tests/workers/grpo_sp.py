"""GRPO runs under sequence parallelism (module-level: picklable for the pool)."""

from __future__ import annotations

from typing import Any

from tests.workers.rlhf_runs import STEP3_DEFAULTS

__all__ = ["grpo_params_run"]


def grpo_params_run(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each named GRPO run in turn, iterated here (the trainer's loop without checkpoints and reports): per
    iteration its metrics plus ``grad_norm`` (the actor's pre-clipping gradient norm of the iteration's last step:
    a wrongly scaled loss shows there, while AdamW's update is blind to a uniform scale), and the actor's full fp32
    parameters at the end (every rank: the gather is collective)."""
    from hybridzero import utils
    from hybridzero.rlhf.settings import GRPOSettings
    from hybridzero.rlhf.steps.rl.grpo import grpo_iteration
    from hybridzero.rlhf.steps.rl.step3 import Step3

    out: dict[str, dict[str, Any]] = {}
    for name, s in runs.items():
        run = Step3(GRPOSettings(**{**STEP3_DEFAULTS, **s}), None)
        try:
            history = []
            for it in range(run.plan.total_iterations):
                metrics = grpo_iteration(run, it)
                metrics["grad_norm"] = float(run.roles.actor.get_global_grad_norm() or float("nan"))
                history.append(metrics)
            params = {
                n: utils.safe_get_full_fp32_param(p).clone() for n, p in run.roles.actor.module.named_parameters()
            }
        finally:
            run.close()
        reward = run.roles.reward
        out[name] = {
            "history": history,
            "params": params,
            "sp": run.roles.actor.sequence_parallel is not None,
            "rm_sp": reward is not None and reward.sequence_parallel is not None,
        }
    return out

"""GRPO and PPO runs under sequence parallelism (module-level: picklable for the pool)."""

from __future__ import annotations

from typing import Any

from tests.workers.rlhf_runs import STEP3_DEFAULTS

__all__ = ["grpo_params_run"]


def grpo_params_run(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each named run in turn (GRPO; PPO where its settings say ``"algorithm": "ppo"``), iterated here (the
    trainer's loop without checkpoints and reports): per iteration its metrics plus ``grad_norm`` (the actor's
    pre-clipping gradient norm of the iteration's last step: a wrongly scaled loss shows there, while AdamW's update
    is blind to a uniform scale; PPO: the critic's too, ``critic_grad_norm``), and the full fp32 parameters at the
    end (every rank: the gather is collective) of the actor, for PPO of the critic (``critic/`` names) and with
    ``enable_ema`` of the EMA actor (``ema/`` names); ``generated``: the rows this rank's rollout engine generated,
    ``rows_gathered_sp`` / ``rows_gathered_elsewhere``: the ledger's calls of the SP rows' all-gather; ``tp_calls``:
    of the tensor-parallel generation group."""
    from hybridzero.rlhf.steps.rl.step3 import Step3

    out: dict[str, dict[str, Any]] = {}
    for name, given in runs.items():
        settings, iteration = _settings_and_iteration(given)
        run = Step3(settings, None)
        generated = _count_generated(run)
        try:
            history = []
            for it in range(run.plan.total_iterations):
                metrics = iteration(run, it)
                metrics["grad_norm"] = float(run.roles.actor.get_global_grad_norm() or float("nan"))
                if run.roles.critic is not None:
                    metrics["critic_grad_norm"] = float(run.roles.critic.get_global_grad_norm() or float("nan"))
                history.append(metrics)
            params = _full_params(run.roles.actor, "")
            if run.roles.critic is not None:
                params.update(_full_params(run.roles.critic, "critic/"))
            if run.roles.ema is not None:
                params.update(_full_params(run.roles.ema, "ema/"))
        finally:
            run.close()
        out[name] = {
            "history": history,
            "params": params,
            "sp": run.roles.actor.sequence_parallel is not None,
            "rm_sp": run.roles.reward is not None and run.roles.reward.sequence_parallel is not None,
            "critic_sp": run.roles.critic is not None and run.roles.critic.sequence_parallel is not None,
            "ema_sp": run.roles.ema is not None and run.roles.ema.sequence_parallel is not None,
            "generated": generated[0],
            **_rows_gathered(run.roles.actor),
        }
    return out


def _count_generated(run: Any) -> list[int]:
    """A counter of the rows this rank's rollout engine is asked to generate (wraps this run's ``_generate``)."""
    count, inner = [0], run._generate

    def counting(prompt_ids: list[int], sample_ids: list[int], run_seed: int) -> Any:
        count[0] += len(prompt_ids)
        return inner(prompt_ids, sample_ids, run_seed)

    run._generate = counting
    return count


def _rows_gathered(actor: Any) -> dict[str, int]:
    """Ledger calls of the rollout rows' all-gather: over the SP group (phase rollout) and over any other group."""
    from hybridzero.rlhf.rollout.sp_split import ROWS_LABEL

    ledger = actor.comm.ledger
    on_sp = ledger.total(ROWS_LABEL, group="sp", phase="rollout").calls
    return {
        "rows_gathered_sp": on_sp,
        "rows_gathered_elsewhere": ledger.total(ROWS_LABEL).calls - on_sp,
        "tp_calls": ledger.total(group="tp").calls,  # tensor-parallel generation's collectives
    }


def _settings_and_iteration(given: dict[str, Any]) -> tuple[Any, Any]:
    """``(settings, iteration function)`` of one run: PPO for ``"algorithm": "ppo"``, else the GRPO family."""
    from hybridzero.rlhf.settings import GRPOSettings, PPOSettings
    from hybridzero.rlhf.steps.rl.grpo import grpo_iteration
    from hybridzero.rlhf.steps.rl.ppo import ppo_iteration

    if given.get("algorithm") == "ppo":
        keys = {k: v for k, v in given.items() if k in PPOSettings.model_fields}  # the shared base has GRPO keys
        return PPOSettings(**{**STEP3_DEFAULTS, **keys}), ppo_iteration
    return GRPOSettings(**{**STEP3_DEFAULTS, **given}), grpo_iteration


def _full_params(engine: Any, prefix: str) -> dict[str, Any]:
    from hybridzero import utils

    return {prefix + n: utils.safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}

"""GRPO-family runs with reward functions on every rank of a world (module-level: picklable for the pool)."""

from __future__ import annotations

import os
from typing import Any

import torch

from tests.workers.rlhf_runs import STEP3_DEFAULTS

__all__ = ["failing_reward_run", "grpo_family_run", "trainer_kill_run"]


def grpo_family_run(runs: dict[str, dict[str, Any]]) -> dict[str, list[dict[str, float]]]:
    """Each named GRPO run in turn (one spawned world for all); returns their histories."""
    from hybridzero.rlhf.settings import GRPOSettings
    from hybridzero.rlhf.steps.rl.trainer import train_step3

    return {name: train_step3(GRPOSettings(**{**STEP3_DEFAULTS, **s}))["history"] for name, s in runs.items()}


def _child_pids() -> set[int]:
    """Pids of this process's children, zombies included (Linux ``/proc``; empty elsewhere)."""
    me, out = os.getpid(), set()
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # not a process, or gone meanwhile
        if int(fields[1]) == me:
            out.add(int(entry))
    return out


def failing_reward_run(settings: dict[str, Any], fail_rank: int) -> dict[str, Any]:
    """A run whose ``tests.workers.rlvr_rewards`` failing functions misbehave on ``fail_rank`` only; returns the
    error this rank raised (``None``: it completed), the history, whether the actor's weights stayed finite, and
    the child processes the run left behind (its reward worker must be closed and reaped, whichever way it ended)."""
    from hybridzero.rlhf.rewards.functions import RewardError
    from hybridzero.rlhf.settings import GRPOSettings
    from hybridzero.rlhf.steps.rl.trainer import train_step3

    before = _child_pids()
    os.environ["RLVR_FAIL_RANK"] = str(fail_rank)  # read by the reward functions (in their worker process)
    try:
        result = train_step3(GRPOSettings(**{**STEP3_DEFAULTS, **settings}))
    except RewardError as exc:
        return {"error": str(exc), "history": None, "finite": None, "left": sorted(_child_pids() - before)}
    finally:
        del os.environ["RLVR_FAIL_RANK"]
    left = sorted(_child_pids() - before)
    if torch.distributed.get_rank() != 0:  # rank 0 writes the final model
        return {"error": None, "history": result["history"], "finite": None, "left": left}
    from safetensors.torch import load_file

    weights = load_file(os.path.join(result["models"]["actor"], "model.safetensors"))
    finite = all(bool(torch.isfinite(w).all()) for w in weights.values())
    return {"error": None, "history": result["history"], "finite": finite, "left": left}


def trainer_kill_run(settings: dict[str, Any], fail_rank: int, out_prefix: str) -> dict[str, Any]:
    """:func:`failing_reward_run` whose reward function, on ``fail_rank``, kills this trainer process (its pid is in
    ``TRAINER_PID``); each surviving rank writes its result to ``out_prefix.rank<R>.json`` (the pool reports the
    dead rank and keeps no value of the others)."""
    import json

    os.environ["TRAINER_PID"] = str(os.getpid())
    result = failing_reward_run(settings, fail_rank)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else int(os.environ["RANK"])
    with open(f"{out_prefix}.rank{rank}.json", "w") as f:
        json.dump({"error": result["error"], "left": result["left"]}, f)
    return result

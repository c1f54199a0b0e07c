"""Per-rank body of tests/distributed/test_rlhf_vllm.py: GRPO iterations on colocated vLLM engines, then what the
engine holds compared with the trainer, then a vLLM failure on one rank (module-level: picklable for the pool)."""

from __future__ import annotations

import os
from typing import Any

import torch

from tests.workers.rlhf_runs import STEP3_DEFAULTS
from tests.workers.rlvr_runs import _child_pids

__all__ = ["vllm_grpo_run"]


def _trainer_weights(actor: Any) -> dict[str, torch.Tensor]:
    """The actor's full weights as the trainer holds them (compute dtype), LoRA merged as DS-Chat exports it."""
    from hybridzero.lora import lora_layers, merged_weights
    from hybridzero.zero import GatheredParameters

    with GatheredParameters(list(actor.module.parameters())):
        state = {n: p.detach().clone() for n, p in actor.module.named_parameters()}
    layers = lora_layers(actor.module)
    scaling = layers[0][1].lora_scaling * layers[0][1].lora_dim if layers else 1.0
    return merged_weights(state, scaling=scaling)


def _broken(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("vLLM engine died (injected)")


def vllm_grpo_run(settings: dict[str, Any], iterations: int, fail_rank: int) -> dict[str, Any]:
    """``iterations`` GRPO iterations with ``rollout_engine="vllm"``; returns the history, the sync count, whether
    the tensors last handed to vLLM equal the trainer's weights bit for bit, the ledger's sync entries, the error a
    rollout raises after ``fail_rank``'s engine starts failing, and the child processes left after ``close``."""
    from hybridzero.rlhf.rollout.backends.vllm_rollout import ensure_synced
    from hybridzero.rlhf.settings import GRPOSettings
    from hybridzero.rlhf.steps.rl.grpo import grpo_iteration
    from hybridzero.rlhf.steps.rl.step3 import Step3

    before = _child_pids()
    launcher = ("LOCAL_WORLD_SIZE", "LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: os.environ.get(k) for k in launcher}
    run = Step3(GRPOSettings(**{**STEP3_DEFAULTS, **settings}), None)
    out: dict[str, Any] = {}
    try:
        assert run.vllm is not None
        run.vllm.keep_sent = True
        out["history"] = [grpo_iteration(run, it) for it in range(iterations)]
        # the engine started in this process: torchrun's environment and torch's thread control are the trainer's
        out["env_kept"] = {k: os.environ.get(k) for k in launcher} == env
        threads = torch.get_num_threads()
        torch.set_num_threads(threads + 1)
        out["threads_settable"] = torch.get_num_threads() == threads + 1
        torch.set_num_threads(threads)
        out["syncs_in_run"] = run.vllm.stats.syncs
        out["steps"] = run.roles.actor.global_steps
        ensure_synced(run.vllm, run.roles.actor)  # the last update's weights
        want = _trainer_weights(run.roles.actor)
        sent = run.vllm.sent
        out["same_names"] = set(sent) == set(want)
        out["bitwise"] = all(torch.equal(sent[n], want[n]) for n in want if n in sent)
        out["dtypes"] = sorted({str(t.dtype) for t in sent.values()})
        ledger = run.roles.actor.comm.ledger
        out["sync_entries"] = ledger.total("weight_sync", phase="rollout_sync").calls
        out["sync_gathers"] = ledger.total("all_gather", phase="rollout_sync").calls
        if run.rank == fail_rank:
            run.vllm.generate = _broken  # type: ignore[method-assign]  # fault injection on this rank only
        try:
            run.sample([0, 1], [0, 1], 7)
            out["error"] = None
        except Exception as exc:  # noqa: BLE001 - the test compares what every rank raised
            out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        run.close()
    out["left"] = sorted(_child_pids() - before)
    return out

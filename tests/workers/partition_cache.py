"""Per-rank body for ``engine.empty_partition_cache()`` at ZeRO-3 with a persistent group (module-level: picklable).

:func:`evicting_run` trains like :func:`tests.harness.parity.engine_run` but empties the partition cache at the
points DeepSpeed users do (after a step, and between a forward and its backward) and probes what the engine answers
while the persistent parameters are evicted: every parameter size 0, ``ds_status`` NOT_AVAILABLE, quiescent; then
each path that must bring them back does (a module holding only persistent parameters called directly, the state
dict, ``GatheredParameters``, the next forward, the backward).
"""

from __future__ import annotations

from typing import Any

import torch

from tests.harness.parity import RunSpec, batches_for, build_model, ds_config


def _all_empty(engine: Any) -> bool:
    """Every parameter of the module is a size-0 placeholder; the persistent ones answer NOT_AVAILABLE."""
    from hybridzero.zero.param_view import ZeroParamStatus

    params = list(engine.module.parameters())
    persistent = [p for p in params if p.ds_persist]
    return (
        bool(persistent)
        and all(p.numel() == 0 for p in params)
        and all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in persistent)
    )


def evicting_run(spec: RunSpec) -> dict[str, Any]:
    """Train ``spec`` (llama, stage 3, a persistence threshold that makes the norms persistent), emptying the
    partition cache after every step and, at step 1, between the forward and the backward. Returns the losses, the
    final full parameters (rank 0) and the probes (each True when it held)."""
    import hybridzero

    hybridzero.init_distributed()
    model = build_model(spec)
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    batches = batches_for(spec, world, int(model.config.vocab_size))
    engine, *_ = hybridzero.initialize(model=model, config=ds_config(spec, world))
    probes: dict[str, bool] = {}
    losses = []
    for s in range(spec.steps):
        ids = batches[s, 0, rank]
        loss = engine(input_ids=ids, labels=ids).loss
        if s == 1:
            engine.empty_partition_cache()  # between forward and backward: the backward brings them back
            probes["between_forward_and_backward"] = _all_empty(engine)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        engine.empty_partition_cache()
        engine.assert_quiescent()
        probes[f"empty_after_step_{s}"] = _all_empty(engine)
        if s == 0:
            hidden = torch.randn(2, 3, 35, generator=torch.Generator().manual_seed(7))
            first = engine.module.model.norm(hidden)  # called directly: a pre-hook rebinds the persistent group
            probes["direct_call"] = engine.module.model.norm.weight.numel() == 35 and torch.equal(
                first, engine.module.model.norm(hidden)
            )
            engine.empty_partition_cache()
        if s == 1:
            full = engine.full_parameters()
            state = engine.module_state_dict()  # every group gathered, the persistent one rebound
            probes["state_dict"] = all(torch.equal(state[n], v) for n, v in full.items())
            engine.empty_partition_cache()
            weight = engine.module.model.norm.weight
            with hybridzero.GatheredParameters([weight]):
                probes["gathered"] = torch.equal(weight.detach(), full["model.norm.weight"])
            engine.assert_quiescent()
            engine.empty_partition_cache()
    params = engine.full_parameters()
    return {"losses": losses, "params": params if rank == 0 else None, "probes": probes}

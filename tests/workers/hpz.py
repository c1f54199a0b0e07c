"""Per-rank hpZ runs: everything that ever made a secondary shard stale, in one training loop."""

from __future__ import annotations

from typing import Any

import torch

from tests.harness.parity import RunSpec, batches_for, build_model, ds_config


def secondaries_match(engine: Any) -> bool:
    """For every group holding a secondary shard: gathering it node-locally gives exactly the primary gather."""
    ok = True
    for g in engine.groups:
        has = torch.tensor([1 if g.secondary_valid() else 0])
        engine.comm.all_reduce(has, op="min", phase="test")
        if not has.item():
            continue
        via_primary = torch.empty(g.layout.padded_numel, dtype=g.compute_dtype)
        engine.comm.all_gather(via_primary, g.compute_shard(), phase="test")
        via_secondary = torch.empty_like(via_primary)
        g.hpz.all_gather(via_secondary, g.secondary, phase="test")
        ok = ok and torch.equal(via_primary, via_secondary)
    return ok


def _grads(engine: Any) -> dict[str, torch.Tensor]:
    out = {}
    for g in engine.groups:
        flat = g.grad_shard if g.master_is_whole else torch.empty(g.layout.padded_numel)
        if not g.master_is_whole:
            engine.comm.all_gather(flat, g.grad_shard, phase="test")
        for s in g.slots:
            out[s.spec.name] = flat[s.spec.offset : s.spec.end].clone()
    return out


def hpz_run(spec: RunSpec, checkpointing: str, ckpt_dir: str | None = None) -> dict[str, Any]:
    """Train with accumulation, fp16 overflow, activation checkpointing, a mid-training no_grad eval forward, a
    GatheredParameters edit and (optionally) a save + load; record losses, gradients, parameters, checks."""
    import hybridzero

    hybridzero.init_distributed()
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    model = build_model(spec)
    inner = getattr(model, "model", model)
    inner.gradient_checkpointing_enable({"use_reentrant": checkpointing == "reentrant"})
    engine, *_ = hybridzero.initialize(model=model, config=ds_config(spec, world))
    batches = batches_for(spec, world, int(inner.config.vocab_size))
    losses, checks, grads = [], [], {}
    for s in range(spec.steps):
        for m in range(spec.accumulation):
            ids = batches[s, m, rank]
            loss = engine(input_ids=ids, labels=ids).loss
            checks.append(secondaries_match(engine))
            if (s, rank) in spec.inf_at and m == 0:
                loss = loss * float("inf")
            engine.backward(loss)
            if m == spec.accumulation - 1 and s == spec.steps - 1:
                grads = _grads(engine)
            engine.step()
            losses.append(loss.item())
        if s == 2:
            with torch.no_grad():
                engine.eval()
                engine(input_ids=batches[s, 0, rank])
                engine.train()
        if s == 3:
            target = engine.module.get_parameter(spec.edit[0])
            with engine.gathered_parameters([target], modifier_rank=0), torch.no_grad():
                target.mul_(0.75)
        if s == 4 and ckpt_dir is not None:
            engine.save_checkpoint(ckpt_dir)
            engine.load_checkpoint(ckpt_dir)
        engine.assert_quiescent()
    params = engine.full_parameters()
    ledger = engine.comm_ledger()
    return {
        "losses": losses,
        "checks": checks,
        "grads": grads if rank == 0 else None,
        "params": params if rank == 0 else None,
        "scales": engine.loss_scale,
        "bwd_world_gather": ledger.total("all_gather", group="world", phase="backward").bytes,
        "bwd_hpz_gather": ledger.total("all_gather", group="hpz", phase="backward").bytes,
    }

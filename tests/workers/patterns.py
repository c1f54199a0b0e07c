"""Per-rank call patterns that have broken ZeRO-3 engines: no_grad train-mode forwards, eval forwards, generation
and activation checkpointing interleaved with training steps (module-level: picklable for the worker pool)."""

from __future__ import annotations

from typing import Any

import torch

from tests.harness.parity import RunSpec, batches_for, build_model, ds_config


def mixed_phases_run(spec: RunSpec, checkpointing: str | None = None) -> dict[str, Any]:
    """Each step: no_grad train-mode forward, eval forward, greedy generate, then a train step; quiescent after each.

    ``checkpointing``: None, "reentrant" or "non_reentrant" (HF ``gradient_checkpointing_enable``).
    """
    import hybridzero

    hybridzero.init_distributed()
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    model = build_model(spec)
    if checkpointing is not None:
        model.gradient_checkpointing_enable({"use_reentrant": checkpointing == "reentrant"})
    batches = batches_for(spec, world, int(model.config.vocab_size))
    engine, *_ = hybridzero.initialize(model=model, config=ds_config(spec, world), record_events=True)
    losses, generated = [], []
    for s in range(spec.steps):
        ids = batches[s, 0, rank]
        engine.train()
        with torch.no_grad():
            engine(input_ids=ids, labels=ids)
        engine.assert_quiescent()
        engine.eval()
        with torch.no_grad():
            engine(input_ids=ids)
            generated.append(
                engine.module.generate(ids[:, :4], max_new_tokens=5, do_sample=False, min_new_tokens=5, pad_token_id=0)
            )
        engine.assert_quiescent()
        engine.train()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        engine.assert_quiescent()
        losses.append(loss.item())
    params = engine.full_parameters()  # a collective: every rank calls it
    return {
        "losses": losses,
        "generated": generated,
        "params": params if rank == 0 else None,
        "invalidations": engine.prefetcher.invalidations,
    }

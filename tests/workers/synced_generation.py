"""Per-rank bodies for a rank leaving ZeRO-3 synced generation (bare ``engine.module.generate``) with an exception
between two forwards (module-level: picklable)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import LogitsProcessorList

import hybridzero
from tests.harness.parity import RunSpec, batches_for, build_model, ds_config
from tests.workers.failures import RaiseAt, _outcome


def abandon_synced_generation(failing: list[int], next_call: str, at: int = 2) -> dict[str, Any]:
    """World W, ZeRO-3: every rank generates once (the reference), then ranks in ``failing`` raise from a logits
    processor at decode step ``at`` and catch it; then the failing ranks make ``next_call`` ("forward": a no-grad
    forward; "retry": generate again) while the others are still in the abandoned generation. Returns each rank's
    outcomes, then a recovery generate on every rank, the ledger's generate-sync calls and the failure state."""
    hybridzero.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    spec = RunSpec(model="opt")
    model = build_model(spec)
    engine, *_ = hybridzero.initialize(model=model, config=ds_config(spec, world))
    ids = batches_for(spec, world, int(model.config.vocab_size))[0, 0, rank][:, :4]
    kw: dict[str, Any] = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    engine.eval()
    seen: dict[str, Any] = {}
    with torch.no_grad():
        reference = engine.module.generate(ids, **kw)
        syncs_per_generate = engine.comm.ledger.total("all_reduce", phase="generate_sync").calls
        procs = LogitsProcessorList([RaiseAt(at)] if rank in failing else [])
        seen["generate"] = _outcome(lambda: engine.module.generate(ids, logits_processor=procs, **kw))
        if rank in failing:
            if next_call == "forward":
                seen["next"] = _outcome(lambda: engine(input_ids=ids))
            else:
                seen["next"] = _outcome(lambda: engine.module.generate(ids, **kw))
        again = engine.module.generate(ids, **kw)
        seen["logits_equal"] = torch.equal(engine(input_ids=ids).logits, model(input_ids=ids).logits)
    seen["recovered"] = torch.equal(again, reference)
    seen["syncs_per_generate"] = syncs_per_generate
    seen["failed"] = engine.comm.failures.failed
    return seen

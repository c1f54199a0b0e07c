"""Per-rank functions that fail on purpose, for the failure-propagation tests (module-level: picklable)."""
from __future__ import annotations

import time
from typing import Any

import torch

from tests.harness.parity import RunSpec, build_model, ds_config


def init_with_bad_config_on(bad_rank: int, bad: dict[str, Any]) -> str:
    """``initialize`` where only ``bad_rank`` gets a broken config; returns/raises what this rank saw."""
    import hybridzero

    hybridzero.init_distributed()
    rank = torch.distributed.get_rank()
    cfg = ds_config(RunSpec(), torch.distributed.get_world_size())
    if rank == bad_rank:
        cfg = {**cfg, **bad}
    hybridzero.initialize(model=build_model(RunSpec()), config=cfg)
    return "initialized"


def step_fails_on(bad_rank: int) -> float:
    """Train one step; ``bad_rank`` feeds an out-of-vocabulary token, so its forward raises mid-step."""
    import hybridzero

    hybridzero.init_distributed()
    rank = torch.distributed.get_rank()
    spec = RunSpec(model="llama")
    engine, *_ = hybridzero.initialize(model=build_model(spec), config=ds_config(spec, torch.distributed.get_world_size()))
    ids = torch.randint(0, 100, (2, 9))
    if rank == bad_rank:
        ids[0, 3] = 10_000
    start = time.monotonic()
    try:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    except Exception as exc:
        exc.add_note(f"after {time.monotonic() - start:.1f}s")
        raise
    return float(loss.detach())

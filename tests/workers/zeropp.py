"""Per-rank ZeRO++ training runs (qwZ / qgZ / hpZ) with ledger totals per collective and group."""

from __future__ import annotations

import time
from typing import Any

import torch


def zeropp_run(extra_zero: dict[str, Any], steps: int, bench_model: bool = False) -> dict[str, Any]:
    """Train ``steps`` steps (benchmark Llama, or the tiny one) with the given ZeRO++ keys; losses and bytes/step."""
    import hybridzero
    from tests.harness.parity import RunSpec, batches_for, build_model, ds_config

    hybridzero.init_distributed()
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    spec = RunSpec(model="llama", steps=steps, lr=1e-3 if bench_model else 3e-3, micro_batch=2, seq_len=16)
    if bench_model:
        from bench_model import benchmark_llama

        model = benchmark_llama()
    else:
        model = build_model(spec)
    cfg = ds_config(spec, world)
    # reuse distance 0: every group is gathered again for backward, so each collective's ZeRO++ effect shows
    cfg["zero_optimization"].update({"stage3_max_reuse_distance": 0, **extra_zero})
    engine, *_ = hybridzero.initialize(model=model, config=cfg)
    vocab = int(model.config.vocab_size)
    pool = batches_for(spec.replace(steps=4), world, vocab)  # a small fixed pool: the loss falls visibly
    mark = engine.comm_ledger().copy()
    losses, seconds = [], []
    for s in range(steps):
        ids = pool[s % 4, 0, rank]
        start = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
    totals: dict[str, int] = {}
    for key, entry in engine.comm_ledger().since(mark).items():
        name = f"{key.collective}/{key.group}"
        totals[name] = totals.get(name, 0) + entry.bytes // steps
    mean = torch.tensor(losses)
    engine.comm.all_reduce(mean, phase="test")
    return {"losses": (mean / world).tolist(), "bytes_per_step": totals, "seconds": seconds}


def zeropp_run_with_local_size(local: str, extra_zero: dict[str, Any]) -> dict[str, Any]:
    """``zeropp_run`` for one step with ``LOCAL_WORLD_SIZE`` overridden in this worker (restored afterwards)."""
    import os

    old = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = local
    try:
        return zeropp_run(extra_zero, 1)
    finally:
        if old is None:
            del os.environ["LOCAL_WORLD_SIZE"]
        else:
            os.environ["LOCAL_WORLD_SIZE"] = old

"""Generation peers of ``bench/bench_generate.py``: FSDP2 unshard-then-generate and DeepSpeed ZeRO-3 generate.

Each function here runs on every rank of a :class:`~tests.harness.spawn.WorldPool` (gloo, one thread per rank)
and returns that rank's timed ``generate`` calls in the format of :func:`generate_common.ranks_row`.

* :func:`fsdp2_rank`: ``fully_shard`` on every decoder layer and then the root (as ``bench/peer_fsdp2.py`` trains),
  ``set_reshard_after_forward(False)``; one timed call is ``unshard()`` of every FSDP module (all-gathers issued
  together, then waited for), greedy ``generate`` on the full parameters with ``synced_gpus=False`` (nothing is
  gathered while decoding, so no rank can wait on another), then ``reshard()``. The gather is inside the time, as
  the hybrid engine's is. All-gathers are counted by ``peer_fsdp2.C10dCounter`` during an untimed call.
* :func:`deepspeed_rank`: ``deepspeed.initialize`` at stage 3 with the benchmark's ZeRO config (no optimizer,
  inference only), ``engine.module.generate(..., synced_gpus=True)``: ZeRO-3 fetches parameters per module in every
  decoding step. All-gathers are counted by DeepSpeed's comms logger during an untimed call (it is switched off for
  the timed ones, since it makes every collective blocking); DeepSpeed logs an all-gather by its input shard, which
  is scaled by the world size to whole-buffer bytes as in ``bench_peers.py``.

Run DeepSpeed in a pool of its own (``DS_ACCELERATOR=cpu``): it installs process-wide state.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from generate_common import (
    ForwardCounter,
    greedy_generate,
    load_model,
    prompts_for,
    timed_calls,
)
from peer_common import collective_kind


def _gather_totals(totals: dict[str, dict[str, int]], scale: int = 1) -> tuple[int, int]:
    """All-gather calls and bytes (times ``scale``) from per-collective-name ``{"calls", "bytes"}`` totals."""
    calls = sum(e["calls"] for n, e in totals.items() if collective_kind(n) == "all_gather")
    nbytes = sum(e["bytes"] for n, e in totals.items() if collective_kind(n) == "all_gather")
    return calls, nbytes * scale


def _shard_for_generate(model: torch.nn.Module, world: int) -> list[Any]:
    """``fully_shard`` every decoder layer and the root on a CPU mesh; the FSDP modules, root last."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_reshard_after_forward(False)  # recursive: a forward never frees what unshard() gathered
    return [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model] + [model]


def fsdp2_rank(settings: dict[str, Any]) -> dict[str, Any]:
    """One FSDP2 rank: unshard every FSDP module, generate greedily on the full parameters, reshard; timed."""
    from peer_fsdp2 import C10dCounter

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = load_model(settings["model"])
    prompts = prompts_for(rank, settings["batch"], settings["prompt_len"], int(model.config.vocab_size))
    fsdp_modules = _shard_for_generate(model, world)

    def run() -> torch.Tensor:
        handles = [m.unshard(async_op=True) for m in fsdp_modules]
        for handle in handles:
            handle.wait()
        try:
            return greedy_generate(model, prompts, settings["new_tokens"], synced_gpus=False)
        finally:
            for m in fsdp_modules:
                m.reshard()

    counter = C10dCounter()
    with counter:
        run()  # untimed: counts the collectives of one call
    forwards = ForwardCounter(model)
    seconds, out = timed_calls(run, settings["repeats"], forwards)
    forwards.remove()
    calls, nbytes = _gather_totals(counter.totals)
    return {
        "seconds": seconds,
        "forwards": forwards.count,
        "gather_calls": calls,
        "gather_bytes": nbytes,
        "tokens": out if rank == 0 else None,
    }


def _deepspeed_engine(settings: dict[str, Any], world: int) -> Any:
    """An inference-only DeepSpeed ZeRO-3 engine on the benchmark model, comms logger on."""
    import deepspeed
    from peer_common import zero_config
    from peer_deepspeed import skip_shm_op_build

    skip_shm_op_build()
    deepspeed.init_distributed(dist_backend="gloo")  # adopts the pool's process group
    config = zero_config(world, "fp32", settings["model"])
    del config["optimizer"]  # inference only: no optimizer state
    config["comms_logger"] = {"enabled": True, "verbose": False, "prof_all": True, "debug": False}
    config["steps_per_print"] = 1 << 30
    engine, *_ = deepspeed.initialize(model=load_model(settings["model"]), config=config)
    engine.eval()
    return engine


def deepspeed_rank(settings: dict[str, Any]) -> dict[str, Any]:
    """One DeepSpeed ZeRO-3 rank: ``engine.module.generate(..., synced_gpus=True)``, timed."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported
    from deepspeed.comm import comm as ds_comm
    from peer_deepspeed import comm_totals

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    engine = _deepspeed_engine(settings, world)
    prompts = prompts_for(rank, settings["batch"], settings["prompt_len"], int(engine.module.config.vocab_size))

    def run() -> torch.Tensor:
        return greedy_generate(engine.module, prompts, settings["new_tokens"], synced_gpus=True)

    comm_totals()  # drop what initialisation logged
    run()  # untimed: counts the collectives of one call
    calls, nbytes = _gather_totals(comm_totals(), scale=world)
    ds_comm.comms_logger.enabled = False  # the logger makes every collective blocking: off for the timed calls
    forwards = ForwardCounter(engine.module)
    seconds, out = timed_calls(run, settings["repeats"], forwards)
    forwards.remove()
    return {
        "seconds": seconds,
        "forwards": forwards.count,
        "gather_calls": calls,
        "gather_bytes": nbytes,
        "tokens": out if rank == 0 else None,
        "deepspeed_version": deepspeed_version(),
    }


def deepspeed_version() -> str:
    """The imported DeepSpeed's version string."""
    import deepspeed

    return str(deepspeed.__version__)

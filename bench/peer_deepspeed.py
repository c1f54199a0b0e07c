"""One DeepSpeed ZeRO-3 rank of ``bench/bench_peers.py`` (run under ``torch.distributed.run``, CPU, gloo).

The engine gets the very JSON that hybridzero gets (:func:`bench_model.benchmark_config`: micro-batch,
AdamW lr 1e-3, clipping 1.0, stage 3, persistence threshold, prefetch bucket, overlap_comm, bf16 flag) plus two
DeepSpeed-only keys: ``torch_adam`` (use ``torch.optim.AdamW`` instead of the JIT-compiled FusedAdam op, which this
install does not build) and ``comms_logger`` (per-step collective calls and bytes). The comms logger makes every
collective blocking, which on CPU/gloo is what gloo does anyway.

Writes ``<out-dir>/deepspeed_rank<R>.json`` (see :mod:`peer_common`).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported: never probe for CUDA

import torch
from peer_common import (
    build_model,
    rank_batches,
    worker_parser,
    write_result,
    zero_config,
)


def deepspeed_config(world: int, dtype: str, model: str = "bench", hpz: int = 1) -> dict[str, Any]:
    """The benchmark's DeepSpeed JSON for ``model`` (and hpZ size) with torch's AdamW and the comms logger on."""
    config = zero_config(world, dtype, model, hpz)
    config["optimizer"]["params"]["torch_adam"] = True
    config["comms_logger"] = {"enabled": True, "verbose": False, "prof_all": True, "debug": False}
    config["steps_per_print"] = 1 << 30
    config["wall_clock_breakdown"] = False
    return config


def comm_totals() -> dict[str, dict[str, int]]:
    """Calls and bytes per collective name recorded by DeepSpeed's comms logger since its last reset; resets it."""
    from deepspeed.comm import comm as ds_comm

    totals: dict[str, dict[str, int]] = {}
    for name, by_size in ds_comm.comms_logger.get_raw_data().items():
        calls = sum(int(entry[0]) for entry in by_size.values())
        nbytes = sum(int(size) * int(entry[0]) for size, entry in by_size.items())
        totals[name] = {"calls": calls, "bytes": nbytes}
    ds_comm.comms_logger.reset_data()
    return totals


def train_step(engine: Any, ids: torch.Tensor) -> dict[str, Any]:
    """Forward, backward and step of the DeepSpeed engine, timed like ``bench_model.measured_step``."""
    comm_totals()  # drop anything logged outside the step
    start = time.perf_counter()
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    step_ms = (time.perf_counter() - start) * 1e3
    grad_norm = engine.get_global_grad_norm()
    return {
        "loss": float(loss.detach().float().item()),
        "step_ms": step_ms,
        "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
        "collectives": comm_totals(),
    }


def skip_shm_op_build() -> None:
    """Keep DeepSpeed from JIT-compiling its CPU shared-memory comm op when the process group comes up.

    That C++ op serves only ``inference_all_reduce`` (never ZeRO-3 training), yet ``TorchBackend`` builds it
    unconditionally, which costs about a minute and a compiler on a fresh machine. Marking it incompatible in
    ``deepspeed.ops.__compatible_ops__`` makes DeepSpeed fall back to plain ``torch.distributed`` (gloo).
    """
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train this rank with ``deepspeed.initialize``; the per-step records (warm-up included)."""
    import deepspeed
    import torch.distributed as dist

    skip_shm_op_build()
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(args.seed, args.model)
    vocab, n_params = int(model.config.vocab_size), sum(p.numel() for p in model.parameters())
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=deepspeed_config(world, args.dtype, args.model, args.hpz),
    )
    batches = rank_batches(args, world, vocab)
    records = [train_step(engine, batches[step, rank]) for step in range(args.warmup + args.steps)]
    dist.barrier()
    dist.destroy_process_group()
    return {
        "rank": rank,
        "world_size": world,
        "n_params": n_params,
        "steps": records,
        "versions": {"deepspeed": deepspeed.__version__},
    }


def main(argv: list[str] | None = None) -> int:
    """Run one DeepSpeed rank and write its JSON file."""
    args = worker_parser(__doc__.splitlines()[0]).parse_args(argv)
    torch.set_num_threads(1)
    write_result(args, "deepspeed", run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

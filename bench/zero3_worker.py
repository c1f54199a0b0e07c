"""One process of ``bench/bench_zero3.py``: a ZeRO-3 rank (under torchrun) or the single-process compute floor.

``--system zero3``: run under ``torch.distributed.run``; each rank trains the benchmark model with the engine and
writes ``<out-dir>/zero3_rank<R>.json``. ``--system floor``: one plain process, no sharding, no process group: the
same per-rank work (same model, micro-batch, AdamW hyperparameters, clipping, one thread) in plain PyTorch, written
to ``<out-dir>/floor.json``. Both run ``--warmup`` unmeasured steps first and then ``--steps`` measured ones.

Each JSON file holds ``rank``, ``world_size``, ``steps`` (one dict per measured step: loss, lr, grad_norm, step_ms
and, for zero3, the ledger's bytes and calls per collective) and ``peak_rss_mib`` (``ru_maxrss`` at the end, which
includes the Python, torch and transformers import).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path
from typing import Any

import torch
from bench_model import (
    benchmark_config,
    benchmark_llama,
    measured_step,
    model_overrides,
    synthetic_batches,
)
from peer_common import add_model_arguments, zero_config


def peak_rss_mib() -> float:
    """Peak resident set size of this process in MiB (``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _model(args: argparse.Namespace) -> torch.nn.Module:
    """The benchmark model variant ``args.model`` (``bench``, ``tiny`` or ``100m``)."""
    return benchmark_llama(args.seed, **model_overrides(args.model))


def run_zero3(args: argparse.Namespace) -> dict[str, Any]:
    """Train this torchrun rank with the engine; the per-step metrics of the measured steps."""
    import torch.distributed as dist

    import hybridzero

    hybridzero.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model(args)
    vocab, n_params = int(model.config.vocab_size), sum(p.numel() for p in model.parameters())
    config = zero_config(world, args.dtype, args.model, args.hpz)
    engine, _, _, _ = hybridzero.initialize(model=model, config=config)
    batches = synthetic_batches(args.seed + 1, steps=args.warmup + args.steps, world_size=world, vocab_size=vocab)
    records = []
    for step in range(args.warmup + args.steps):
        metrics = measured_step(engine, batches[step, rank])
        if step >= args.warmup:
            records.append(metrics.as_dict())
    engine.assert_quiescent()
    dist.destroy_process_group()
    return {"rank": rank, "world_size": world, "n_params": n_params, "steps": records}


def _floor_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor, args: argparse.Namespace, clipping: float
) -> dict[str, float]:
    """One plain-PyTorch step (forward, backward, clip, AdamW, zero_grad), timed like ``measured_step``."""
    lr = float(opt.param_groups[0]["lr"])
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clipping)
    opt.step()
    opt.zero_grad(set_to_none=True)
    step_ms = (time.perf_counter() - start) * 1e3
    return {"loss": float(loss.detach().float().item()), "lr": lr, "grad_norm": float(norm), "step_ms": step_ms}


def run_floor(args: argparse.Namespace) -> dict[str, Any]:
    """The unsharded compute floor in this process (bf16 via CPU autocast over fp32 weights)."""
    torch.set_num_threads(1)  # each ZeRO-3 rank runs with OMP_NUM_THREADS=1
    model = _model(args)
    config = benchmark_config(1, dtype=args.dtype)
    params = config["optimizer"]["params"]
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=params["lr"],
        betas=tuple(params["betas"]),
        eps=params["eps"],
        weight_decay=params["weight_decay"],
    )
    vocab = int(model.config.vocab_size)
    batches = synthetic_batches(args.seed + 1, steps=args.warmup + args.steps, world_size=1, vocab_size=vocab)
    records = []
    for step in range(args.warmup + args.steps):
        record = _floor_step(model, opt, batches[step, 0], args, config["gradient_clipping"])
        if step >= args.warmup:
            records.append(record)
    n_params = sum(p.numel() for p in model.parameters())
    return {"rank": 0, "world_size": 1, "n_params": n_params, "steps": records}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments of one worker."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--system", choices=("zero3", "floor"), required=True)
    p.add_argument("--steps", type=int, required=True, help="measured steps")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps before them")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--seed", type=int, default=0)
    add_model_arguments(p)  # --model / --tiny / --hpz
    p.add_argument("--out-dir", type=Path, required=True)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run one worker and write its JSON file."""
    args = parse_args(argv)
    result = run_zero3(args) if args.system == "zero3" else run_floor(args)
    result.update(system=args.system, peak_rss_mib=peak_rss_mib(), pid=os.getpid())
    name = f"zero3_rank{result['rank']}.json" if args.system == "zero3" else "floor.json"
    (args.out_dir / name).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

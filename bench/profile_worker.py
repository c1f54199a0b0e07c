"""One process of ``bench/bench_profile.py``: a profiled ZeRO-3 rank (under torchrun) or the profiled compute floor.

``--system zero3``: each rank trains the benchmark model with the engine, its ledger's step timer on, and writes
``<out-dir>/zero3_rank<R>.json``. ``--system floor``: one plain process, one thread, no sharding: the same per-rank
work (forward, backward, clipping, AdamW) in plain PyTorch with the same timer, written to ``<out-dir>/floor.json``.

Per measured step: ``wall_ms`` (forward + backward + step, one ``perf_counter`` pair) and ``regions`` (exclusive ms
per profile region; see ``bench/profile_parts.py``), and the loss.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from bench_model import benchmark_config, synthetic_batches
from peer_common import add_model_arguments, build_model, zero_config

from hybridzero.comm.timing import StepTimer

CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
"""``--clock``: wall time, or this thread's CPU time (not inflated by other processes on the same cores)."""


def _record(timer: StepTimer, start: tuple[float, float, float], loss: torch.Tensor) -> dict[str, Any]:
    """This step's record; ``start`` is (the timer's clock, process CPU time, this thread's CPU time) at its start."""
    wall_ms = (timer.clock() - start[0]) * 1e3
    regions = {name: seconds * 1e3 for name, seconds in timer.take().items()}
    return {
        "wall_ms": wall_ms,
        "process_cpu_ms": (time.process_time() - start[1]) * 1e3,  # every thread: gloo's transport threads too
        "thread_cpu_ms": (time.thread_time() - start[2]) * 1e3,
        "regions": regions,
        "loss": float(loss.detach().float().item()),
    }


def _start(timer: StepTimer) -> tuple[float, float, float]:
    return timer.clock(), time.process_time(), time.thread_time()


def run_zero3(args: argparse.Namespace) -> dict[str, Any]:
    """Train this torchrun rank with the engine, profiled; the measured steps."""
    import torch.distributed as dist

    import hybridzero

    hybridzero.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(args.seed, args.model)
    config = zero_config(world, args.dtype, args.model)
    if args.reduce_bucket is not None:
        config["zero_optimization"]["reduce_bucket_size"] = args.reduce_bucket
    engine, _, _, _ = hybridzero.initialize(model=model, config=config)
    batches = synthetic_batches(
        args.seed + 1, steps=args.warmup + args.steps, world_size=world, vocab_size=int(model.config.vocab_size)
    )
    timer = engine.comm_ledger().timer
    timer.enabled, timer.clock = True, CLOCKS[args.clock]
    records = []
    for step in range(args.warmup + args.steps):
        ids = batches[step, rank]
        timer.reset()
        start = _start(timer)
        with timer.region("compute.forward"):
            loss = engine(input_ids=ids, labels=ids).loss
        with timer.region("compute.backward"):
            engine.backward(loss)
        with timer.region("hooks.step"):
            engine.step()
        record = _record(timer, start, loss)
        if step >= args.warmup:
            records.append(record)
    engine.assert_quiescent()
    dist.destroy_process_group()
    return {"rank": rank, "world_size": world, "steps": records}


def run_floor(args: argparse.Namespace) -> dict[str, Any]:
    """The unsharded compute floor (one thread; bf16 through CPU autocast over fp32 weights), profiled."""
    torch.set_num_threads(1)
    model = build_model(args.seed, args.model)
    config = benchmark_config(1, dtype=args.dtype)
    params = config["optimizer"]["params"]
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=params["lr"],
        betas=tuple(params["betas"]),
        eps=params["eps"],
        weight_decay=params["weight_decay"],
        foreach=True,  # torch's fastest CPU path that is bitwise its per-tensor loop: the floor is the best plain step
    )
    batches = synthetic_batches(
        args.seed + 1, steps=args.warmup + args.steps, world_size=1, vocab_size=int(model.config.vocab_size)
    )
    timer = StepTimer(CLOCKS[args.clock])
    timer.enabled = True
    records = []
    for step in range(args.warmup + args.steps):
        ids = batches[step, 0]
        timer.reset()
        start = _start(timer)
        with timer.region("compute.forward"):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
                loss = model(input_ids=ids, labels=ids).loss
        with timer.region("compute.backward"):
            loss.backward()
        with timer.region("compute.optimizer"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), config["gradient_clipping"])
            opt.step()
            opt.zero_grad(set_to_none=True)
        record = _record(timer, start, loss)
        if step >= args.warmup:
            records.append(record)
    return {"rank": 0, "world_size": 0, "steps": records}


def main(argv: list[str] | None = None) -> int:
    """Run one worker and write its JSON file."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--system", choices=("zero3", "floor"), required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clock", choices=tuple(CLOCKS), default="wall")
    p.add_argument("--reduce-bucket", type=int, default=None, help="reduce_bucket_size (default: the benchmark's)")
    add_model_arguments(p)
    p.add_argument("--out-dir", type=Path, required=True)
    args = p.parse_args(argv)
    result = run_zero3(args) if args.system == "zero3" else run_floor(args)
    name = f"zero3_rank{result['rank']}.json" if args.system == "zero3" else "floor.json"
    (args.out_dir / name).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

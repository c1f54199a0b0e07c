"""Train the benchmark Llama (:mod:`bench_model`) with ZeRO-3 and print per-step metrics (the engine demo).

``python bench/train_demo.py --world-size 2 --steps 30 [--tiny]``. Started outside torchrun (no ``RANK`` in the
environment) it relaunches itself as ``python -m torch.distributed.run --standalone --nproc_per_node N
bench/train_demo.py …`` with ``OMP_NUM_THREADS=1`` and returns that launcher's exit status. Under torchrun every rank
trains and rank 0 prints one line per step and a summary. Byte counts are whole-buffer bytes from the engine's comm
ledger, in MB (10⁶ B).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing
sys.path.insert(0, str(HERE))

_MB = 1e6


def build_parser() -> argparse.ArgumentParser:
    """The demo's arguments."""
    p = argparse.ArgumentParser(
        prog="train_demo",
        description="Train the benchmark Llama (bench_model) with ZeRO-3 on synthetic, learnable "
        "data. Relaunches itself under torch.distributed.run unless RANK is already set.",
    )
    p.add_argument("--world-size", type=int, default=2, help="ranks to launch (default 2)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="compute dtype (default fp32)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate of the warm-up/decay schedule")
    p.add_argument("--seed", type=int, default=0, help="model and data seed (default 0)")
    p.add_argument("--tiny", action="store_true", help="a tiny model (vocab 512, hidden 64, 2 blocks) for smoke runs")
    return p


def _train_demo(args: argparse.Namespace) -> int:
    """Relaunch under torchrun, or (already a torchrun rank) train."""
    if args.world_size < 1 or args.steps < 1:
        print("train_demo: --world-size and --steps must be >= 1", file=sys.stderr)
        return 2
    if "RANK" not in os.environ:
        return _relaunch(args)
    return _train_demo_rank(args)


def _demo_argv(args: argparse.Namespace) -> list[str]:
    """The ``train-demo`` arguments that reproduce ``args``."""
    argv = [
        "--world-size",
        str(args.world_size),
        "--steps",
        str(args.steps),
        "--dtype",
        args.dtype,
        "--lr",
        repr(args.lr),
        "--seed",
        str(args.seed),
    ]
    return argv + (["--tiny"] if args.tiny else [])


def _relaunch(args: argparse.Namespace) -> int:
    """Run this command again under ``torch.distributed.run`` with ``args.world_size`` local ranks."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(args.world_size),
        str(Path(__file__).resolve()),
        *_demo_argv(args),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        return subprocess.run(cmd, env=env, check=False).returncode
    except KeyboardInterrupt:
        return 130


def format_step_line(step: int, steps: int, metrics: Any, tokens_per_step: int) -> str:
    """One rank-0 step line: step, loss, lr, grad norm, time, global tokens/s, this step's gather/scatter MB."""
    tok_s = tokens_per_step / (metrics.step_ms / 1e3) if metrics.step_ms > 0 else float("nan")
    return (
        f"step {step:>4}/{steps} | loss {metrics.loss:7.4f} | lr {metrics.lr:.2e} | "
        f"grad {metrics.grad_norm:7.3f} | {metrics.step_ms:8.1f} ms | {tok_s:8.0f} tok/s | "
        f"AG {metrics.all_gather_bytes / _MB:7.2f} MB | RS {metrics.reduce_scatter_bytes / _MB:7.2f} MB"
    )


def format_summary(history: Sequence[Any], tokens_per_step: int) -> str:
    """The closing summary of a run: first/last loss, median step time and throughput, bytes per step."""
    med_ms = statistics.median(m.step_ms for m in history)
    mean = {
        k: statistics.fmean(getattr(m, k) for m in history)
        for k in (
            "all_gather_bytes",
            "all_gather_calls",
            "reduce_scatter_bytes",
            "reduce_scatter_calls",
            "all_reduce_bytes",
            "all_reduce_calls",
        )
    }
    return "\n".join(
        [
            f"summary: {len(history)} steps | loss {history[0].loss:.4f} -> {history[-1].loss:.4f} "
            "(first -> last, rank 0)",
            f"summary: median step {med_ms:.1f} ms | {tokens_per_step / (med_ms / 1e3):.0f} tok/s (all ranks)",
            f"summary: per step: all-gather {mean['all_gather_bytes'] / _MB:.2f} MB in {mean['all_gather_calls']:.1f} "
            f"calls | reduce-scatter {mean['reduce_scatter_bytes'] / _MB:.2f} MB in {mean['reduce_scatter_calls']:.1f} "
            f"calls | all-reduce {mean['all_reduce_bytes'] / _MB:.4f} MB in {mean['all_reduce_calls']:.1f} calls",
        ]
    )


def _build_demo_engine(args: argparse.Namespace, world: int) -> tuple[Any, int]:
    """The ZeRO-3 engine over the benchmark model and its parameter count."""
    from bench_model import benchmark_config, benchmark_llama, tiny_overrides

    import hybridzero

    model = benchmark_llama(args.seed, **(tiny_overrides() if args.tiny else {}))
    n_params = sum(p.numel() for p in model.parameters())
    config = benchmark_config(world, dtype=args.dtype, steps=args.steps, lr=args.lr)
    engine, _, _, _ = hybridzero.initialize(model=model, config=config)
    return engine, n_params


def _train_demo_rank(args: argparse.Namespace) -> int:
    """One torchrun rank of ``train-demo``; rank 0 prints."""
    import torch.distributed as dist
    from bench_model import MICRO_BATCH, SEQ_LEN, measured_step, synthetic_batches

    import hybridzero

    hybridzero.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        engine, n_params = _build_demo_engine(args, world)
        vocab = int(engine.module.config.vocab_size)
        batches = synthetic_batches(args.seed + 1, steps=args.steps, world_size=world, vocab_size=vocab)
        tokens = world * MICRO_BATCH * SEQ_LEN
        if rank == 0:
            print(
                f"train_demo: {world} ranks, {args.dtype}, Llama {n_params / 1e6:.2f} M params, micro-batch "
                f"{MICRO_BATCH}x{SEQ_LEN} per rank, {args.steps} steps (loss of rank 0's micro-batch; MB = "
                f"whole-buffer bytes from the comm ledger)",
                flush=True,
            )
        history = []
        for step in range(args.steps):
            metrics = measured_step(engine, batches[step, rank])
            history.append(metrics)
            if rank == 0:
                print(format_step_line(step + 1, args.steps, metrics, tokens), flush=True)
        engine.assert_quiescent()
        if rank == 0:
            print(format_summary(history, tokens), flush=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse and run."""
    return _train_demo(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

"""The ``hybridzero`` command line (``python -m hybridzero …`` or the ``hybridzero`` console script).

Subcommands are registered by small ``_add_*`` functions listed in :func:`build_parser`, each setting a handler
``func(args) -> int``; the RLHF commands (sft, reward, ppo, grpo, plot, demo) come from :mod:`hybridzero.rlhf.cli`.

``export CKPT_DIR OUT_DIR`` writes a Hugging Face directory (``config.json`` + safetensors) from an engine
checkpoint, streaming one shard file at a time (:func:`hybridzero.checkpoint.export.export_hf`); errors (unknown tag,
non-empty destination, no HF config) print one line to stderr and exit 1.

``train-demo`` trains the benchmark Llama (:mod:`hybridzero.bench_model`) with ZeRO-3. Started outside torchrun
(no ``RANK`` in the environment) it relaunches itself as
``python -m torch.distributed.run --standalone --nproc_per_node N -m hybridzero train-demo …`` with
``OMP_NUM_THREADS=1`` and returns that launcher's exit status. Under torchrun every rank trains and rank 0 prints
one line per step and a summary. Byte counts are whole-buffer bytes from the engine's comm ledger, in MB (10⁶ B).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["build_parser", "format_step_line", "format_summary", "main", "parse_size"]

_MB = 1e6


def _add_train_demo(subparsers: Any) -> None:
    """Register ``train-demo``."""
    p = subparsers.add_parser(
        "train-demo", help="train the benchmark Llama with ZeRO-3 on N local ranks and print per-step metrics",
        description="Train the benchmark Llama (hybridzero.bench_model) with ZeRO-3 on synthetic, learnable data. "
                    "Relaunches itself under torch.distributed.run unless RANK is already set.")
    p.add_argument("--world-size", type=int, default=2, help="ranks to launch (default 2)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="compute dtype (default fp32)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate of the warm-up/decay schedule")
    p.add_argument("--seed", type=int, default=0, help="model and data seed (default 0)")
    p.add_argument("--tiny", action="store_true", help="a tiny model (vocab 512, hidden 64, 2 blocks) for smoke runs")
    p.set_defaults(func=_train_demo)


def _add_export(subparsers: Any) -> None:
    """Register ``export``."""
    p = subparsers.add_parser(
        "export", help="write a Hugging Face directory (config.json + safetensors) from an engine checkpoint",
        description="Export checkpoint TAG (default: the one 'latest' names) of CKPT_DIR to OUT_DIR, which "
                    "AutoModelForCausalLM.from_pretrained loads. Streams one shard file at a time.")
    p.add_argument("ckpt_dir", metavar="CKPT_DIR", help="checkpoint directory (holds 'latest' and tag folders)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="destination; must not exist or be empty")
    p.add_argument("--tag", default=None, help="checkpoint tag (default: the one 'latest' names)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="weight dtype (default fp32)")
    p.add_argument("--max-shard-size", type=parse_size, default="5GiB",
                   help="largest safetensors file, e.g. 20KB, 500MB, 5GB (powers of 10) or 5GiB (of 2); default 5GiB")
    p.set_defaults(func=_export)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per subcommand."""
    parser = argparse.ArgumentParser(prog="hybridzero", description="hybridzero: ZeRO-3 sharded training tools.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    from hybridzero.rlhf.cli import add_rlhf_commands

    for add in (_add_train_demo, _add_export, add_rlhf_commands):
        add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand and return its exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    return int(args.func(args))


# --- export -----------------------------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    """Bytes of a size such as ``20KB``, ``5GB`` (10³ steps, like transformers), ``5GiB`` (2¹⁰ steps) or ``1024``."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    body = text.strip().upper()
    number = body.rstrip("KMGTIB")
    unit = body[len(number):]
    try:
        value = float(number) * units[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: use e.g. 20KB, 500MB, 5GB or 5GiB") from None
    if not 1 <= value < float("inf"):  # also rejects nan
        raise argparse.ArgumentTypeError(f"size {text!r} must be a finite number of at least 1 byte")
    return int(value)


def _export(args: argparse.Namespace) -> int:
    """Run :func:`hybridzero.checkpoint.export.export_hf`; one error line and status 1 on bad input."""
    from hybridzero.checkpoint.export import export_hf

    try:
        out = export_hf(args.ckpt_dir, args.out_dir, args.tag, dtype=args.dtype, max_shard_bytes=args.max_shard_size)
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        print(f"export: error: {exc}", file=sys.stderr)
        return 1
    files = sorted(p.name for p in out.iterdir())
    print(f"export: wrote {len(files)} files to {out}: {', '.join(files)}")
    return 0


# --- train-demo -------------------------------------------------------------------------------------------------
def _train_demo(args: argparse.Namespace) -> int:
    """Relaunch under torchrun, or (already a torchrun rank) train."""
    if args.world_size < 1 or args.steps < 1:
        print("train-demo: --world-size and --steps must be >= 1", file=sys.stderr)
        return 2
    if "RANK" not in os.environ:
        return _relaunch(args)
    return _train_demo_rank(args)


def _demo_argv(args: argparse.Namespace) -> list[str]:
    """The ``train-demo`` arguments that reproduce ``args``."""
    argv = ["train-demo", "--world-size", str(args.world_size), "--steps", str(args.steps),
            "--dtype", args.dtype, "--lr", repr(args.lr), "--seed", str(args.seed)]
    return argv + (["--tiny"] if args.tiny else [])


def _relaunch(args: argparse.Namespace) -> int:
    """Run this command again under ``torch.distributed.run`` with ``args.world_size`` local ranks."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.world_size),
           "-m", "hybridzero", *_demo_argv(args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        return subprocess.run(cmd, env=env, check=False).returncode
    except KeyboardInterrupt:
        return 130


def format_step_line(step: int, steps: int, metrics: Any, tokens_per_step: int) -> str:
    """One rank-0 step line: step, loss, lr, grad norm, time, global tokens/s, this step's gather/scatter MB."""
    tok_s = tokens_per_step / (metrics.step_ms / 1e3) if metrics.step_ms > 0 else float("nan")
    return (f"step {step:>4}/{steps} | loss {metrics.loss:7.4f} | lr {metrics.lr:.2e} | "
            f"grad {metrics.grad_norm:7.3f} | {metrics.step_ms:8.1f} ms | {tok_s:8.0f} tok/s | "
            f"AG {metrics.all_gather_bytes / _MB:7.2f} MB | RS {metrics.reduce_scatter_bytes / _MB:7.2f} MB")


def format_summary(history: Sequence[Any], tokens_per_step: int) -> str:
    """The closing summary of a run: first/last loss, median step time and throughput, bytes per step."""
    med_ms = statistics.median(m.step_ms for m in history)
    mean = {k: statistics.fmean(getattr(m, k) for m in history)
            for k in ("all_gather_bytes", "all_gather_calls", "reduce_scatter_bytes", "reduce_scatter_calls",
                      "all_reduce_bytes", "all_reduce_calls")}
    return "\n".join([
        f"summary: {len(history)} steps | loss {history[0].loss:.4f} -> {history[-1].loss:.4f} (first -> last, rank 0)",
        f"summary: median step {med_ms:.1f} ms | {tokens_per_step / (med_ms / 1e3):.0f} tok/s (all ranks)",
        f"summary: per step: all-gather {mean['all_gather_bytes'] / _MB:.2f} MB in {mean['all_gather_calls']:.1f} "
        f"calls | reduce-scatter {mean['reduce_scatter_bytes'] / _MB:.2f} MB in {mean['reduce_scatter_calls']:.1f} "
        f"calls | all-reduce {mean['all_reduce_bytes'] / _MB:.4f} MB in {mean['all_reduce_calls']:.1f} calls",
    ])


def _build_demo_engine(args: argparse.Namespace, world: int) -> tuple[Any, int]:
    """The ZeRO-3 engine over the benchmark model and its parameter count."""
    import hybridzero
    from hybridzero.bench_model import benchmark_config, benchmark_llama, tiny_overrides

    model = benchmark_llama(args.seed, **(tiny_overrides() if args.tiny else {}))
    n_params = sum(p.numel() for p in model.parameters())
    config = benchmark_config(world, dtype=args.dtype, steps=args.steps, lr=args.lr)
    engine, _, _, _ = hybridzero.initialize(model=model, config=config)
    return engine, n_params


def _train_demo_rank(args: argparse.Namespace) -> int:
    """One torchrun rank of ``train-demo``; rank 0 prints."""
    import torch.distributed as dist

    import hybridzero
    from hybridzero.bench_model import MICRO_BATCH, SEQ_LEN, measured_step, synthetic_batches

    hybridzero.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        engine, n_params = _build_demo_engine(args, world)
        vocab = int(engine.module.config.vocab_size)
        batches = synthetic_batches(args.seed + 1, steps=args.steps, world_size=world, vocab_size=vocab)
        tokens = world * MICRO_BATCH * SEQ_LEN
        if rank == 0:
            print(f"train-demo: {world} ranks, {args.dtype}, Llama {n_params / 1e6:.2f} M params, micro-batch "
                  f"{MICRO_BATCH}x{SEQ_LEN} per rank, {args.steps} steps (loss of rank 0's micro-batch; MB = "
                  f"whole-buffer bytes from the comm ledger)", flush=True)
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

"""Helpers shared by the peer-benchmark workers (``peer_deepspeed.py``, ``peer_fsdp2.py``) and their driver.

A worker is one torchrun rank. It trains the benchmark model (:mod:`bench_model`) for ``--warmup`` +
``--steps`` steps on :func:`bench_model.synthetic_batches` and writes ``<out-dir>/<system>_rank<R>.json``
in the format of ``bench/zero3_worker.py``: ``rank``, ``world_size``, ``n_params``, ``steps`` (one dict per step,
warm-up included, each with at least ``loss`` and ``step_ms``), ``peak_rss_mib`` and ``system``.

This module imports no torch at top level, so the driver (``bench_peers.py``) can import it cheaply.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

MODEL_CHOICES: tuple[str, ...] = ("bench", "tiny", "100m")
"""``--model`` choices; the same names as :data:`bench_model.MODEL_CHOICES` (kept here torch-free)."""
COLLECTIVE_KINDS: tuple[str, ...] = ("all_gather", "reduce_scatter", "all_reduce", "other")
"""Buckets into which a system's collective names are folded for the comparison table."""


def peak_rss_mib() -> float:
    """Peak resident set size of this process in MiB (``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def collective_kind(name: str) -> str:
    """Fold a collective's name (DeepSpeed's log names, c10d op names) into one of :data:`COLLECTIVE_KINDS`."""
    flat = name.lower().replace("_", "")
    if "allgather" in flat:
        return "all_gather"
    if "reducescatter" in flat:
        return "reduce_scatter"
    if "allreduce" in flat:
        return "all_reduce"
    return "other"


def deepspeed_available() -> bool:
    """Whether ``import deepspeed`` succeeds, tried in a child interpreter so that the driver stays light."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "DS_BUILD_OPS": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", "import deepspeed"], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    return proc.returncode == 0


def worker_parser(description: str) -> argparse.ArgumentParser:
    """The command line every peer worker accepts (``--tiny`` is an alias of ``--model tiny``)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, required=True, help="measured steps")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps before them (still recorded)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--seed", type=int, default=0)
    add_model_arguments(p)
    p.add_argument("--out-dir", type=Path, required=True)
    return p


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """``--model {bench,tiny,100m}``, ``--tiny`` (alias of ``--model tiny``) and ``--hpz`` (ZeRO++ hpZ size)."""
    p.add_argument(
        "--model", choices=MODEL_CHOICES, default="bench", help="benchmark model variant (bench_model.model_overrides)"
    )
    p.add_argument("--tiny", dest="model", action="store_const", const="tiny", help="alias of --model tiny")
    p.add_argument(
        "--hpz",
        type=int,
        default=1,
        help="zero_hpz_partition_size (hybridzero, DeepSpeed); FSDP2: reshard_after_forward=N",
    )


def build_model(seed: int, model: str) -> Any:
    """The benchmark Llama variant ``model`` (:data:`MODEL_CHOICES`), identical on every rank and in every system."""
    from bench_model import benchmark_llama, model_overrides

    return benchmark_llama(seed, **model_overrides(model))


def zero_config(world: int, dtype: str, model: str, hpz: int = 1) -> dict[str, Any]:
    """The benchmark's DeepSpeed-format JSON for ``model`` (prefetch bucket: two of its blocks); hpZ if ``hpz > 1``.

    hybridzero and DeepSpeed read the same ``zero_optimization.zero_hpz_partition_size`` key.
    """
    from bench_model import (
        benchmark_config,
        prefetch_bucket_for,
        reduce_bucket_for,
    )

    config = benchmark_config(
        world, dtype=dtype, prefetch_bucket_size=prefetch_bucket_for(model), reduce_bucket_size=reduce_bucket_for(model)
    )
    if hpz > 1:
        config["zero_optimization"]["zero_hpz_partition_size"] = hpz
    return config


def rank_batches(args: argparse.Namespace, world: int, vocab: int) -> Any:
    """All steps' token ids ``[steps, world, micro_batch, seq_len]``, the same stream every system sees."""
    from bench_model import synthetic_batches

    return synthetic_batches(args.seed + 1, steps=args.warmup + args.steps, world_size=world, vocab_size=vocab)


def adamw_settings(world: int) -> tuple[dict[str, Any], float]:
    """The benchmark's AdamW keyword arguments (torch names) and its gradient-clipping norm."""
    from bench_model import benchmark_config

    config = benchmark_config(world)
    params = config["optimizer"]["params"]
    kwargs = {
        "lr": params["lr"],
        "betas": tuple(params["betas"]),
        "eps": params["eps"],
        "weight_decay": params["weight_decay"],
    }
    return kwargs, float(config["gradient_clipping"])


def write_result(args: argparse.Namespace, system: str, result: dict[str, Any]) -> Path:
    """Add RSS, pid and system to ``result`` and write it as ``<out-dir>/<system>_rank<R>.json``."""
    result.update(system=system, peak_rss_mib=peak_rss_mib(), pid=os.getpid(), warmup=args.warmup)
    path = args.out_dir / f"{system}_rank{result['rank']}.json"
    path.write_text(json.dumps(result, indent=1))
    return path

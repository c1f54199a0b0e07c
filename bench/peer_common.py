"""Helpers shared by the peer-benchmark workers (``peer_deepspeed.py``, ``peer_fsdp2.py``) and their driver.

A worker is one torchrun rank. It trains the benchmark model (:mod:`hybridzero.bench_model`) for ``--warmup`` +
``--steps`` steps on :func:`hybridzero.bench_model.synthetic_batches` and writes ``<out-dir>/<system>_rank<R>.json``
in the format of ``bench/zero3_worker.py``: ``rank``, ``world_size``, ``n_params``, ``steps`` (one dict per step,
warm-up included, each with at least ``loss`` and ``step_ms``), ``peak_rss_mib`` and ``system``.

This module imports no torch at top level, so the driver (``bench_peers.py``) can import it cheaply.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
from pathlib import Path
from typing import Any

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


def worker_parser(description: str) -> argparse.ArgumentParser:
    """The command line every peer worker accepts."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, required=True, help="measured steps")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps before them (still recorded)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="the tiny model variant (smoke tests)")
    p.add_argument("--out-dir", type=Path, required=True)
    return p


def build_model(seed: int, tiny: bool) -> Any:
    """The benchmark Llama (or its tiny variant), identical on every rank and in every system."""
    from hybridzero.bench_model import benchmark_llama, tiny_overrides

    return benchmark_llama(seed, **(tiny_overrides() if tiny else {}))


def rank_batches(args: argparse.Namespace, world: int, vocab: int) -> Any:
    """All steps' token ids ``[steps, world, micro_batch, seq_len]``, the same stream every system sees."""
    from hybridzero.bench_model import synthetic_batches

    return synthetic_batches(args.seed + 1, steps=args.warmup + args.steps, world_size=world, vocab_size=vocab)


def adamw_settings(world: int) -> tuple[dict[str, Any], float]:
    """The benchmark's AdamW keyword arguments (torch names) and its gradient-clipping norm."""
    from hybridzero.bench_model import benchmark_config

    config = benchmark_config(world)
    params = config["optimizer"]["params"]
    kwargs = {"lr": params["lr"], "betas": tuple(params["betas"]), "eps": params["eps"],
              "weight_decay": params["weight_decay"]}
    return kwargs, float(config["gradient_clipping"])


def write_result(args: argparse.Namespace, system: str, result: dict[str, Any]) -> Path:
    """Add RSS, pid and system to ``result`` and write it as ``<out-dir>/<system>_rank<R>.json``."""
    result.update(system=system, peak_rss_mib=peak_rss_mib(), pid=os.getpid(), warmup=args.warmup)
    path = args.out_dir / f"{system}_rank{result['rank']}.json"
    path.write_text(json.dumps(result, indent=1))
    return path

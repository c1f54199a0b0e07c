"""Generation on sharded parameters against plain ``generate`` (CPU, gloo): the hybrid engine, ZeRO-3 per-forward
gathering, FSDP2 unshard-then-generate and DeepSpeed ZeRO-3.

    python bench/bench_generate.py [--world 2] [--batch 8] [--prompt-len 16] [--new-tokens 64] [--repeats 3]
                                   [--model bench|tiny|100m] [--systems ...] [--out bench/results]

The benchmark model (:func:`bench_model.benchmark_llama`; ``--tiny`` is an alias of ``--model tiny``)
generates greedily, exactly ``--new-tokens`` tokens (``min_new_tokens`` = ``max_new_tokens``, so nobody stops early)
for ``--batch`` prompts of ``--prompt-len`` random tokens, with the KV cache on, fp32:

* ``plain``: the unsharded model in this process, one thread, one batch: the compute floor of one rank alone.
* ``plain-ranks``: W processes at once, each generating on its own unsharded copy (no collective): the same floor
  under the CPU and memory-bandwidth sharing every W-rank system runs under (the like-for-like baseline on a
  machine with as many cores as ranks).
* ``hybrid``: hybridzero's hybrid engine (``engine.generate``): parameters gathered once per call.
* ``hybrid-tp``: the hybrid engine with ``hybrid_engine.inference_tp_size`` = ``--tp``: groups of ``--tp`` ranks
  decode their joint batch on ``1/tp`` of every projection each (two all-reduces per layer and token inside the
  group); "params held MB" is what a rank holds while decoding (the whole model for ``hybrid``).
* ``zero3`` / ``zero3-noprefetch``: ``--world`` ranks (a :class:`~tests.harness.spawn.WorldPool`, one thread
  each), one inference-only ZeRO-3 engine per rank with the benchmark's prefetch bucket (or prefetch off),
  ``engine.module.generate``: every decoding step all-gathers the whole model once.
* ``fsdp2``: PyTorch FSDP2, ``unshard()`` every FSDP module, generate on full parameters, ``reshard()``
  (:func:`generate_peers.fsdp2_rank`; the gather is inside the time).
* ``deepspeed``: DeepSpeed ZeRO-3, ``engine.module.generate(..., synced_gpus=True)`` (:func:`generate_peers.
  deepspeed_rank`, in a pool of its own); skipped, with the reason printed and recorded, when ``deepspeed`` is not
  importable.

Every rank generates its own batch. Per system: median / min / max seconds per ``generate`` over ``--repeats`` timed
calls after a warm-up (a multi-rank call's time is its slowest rank's), new tokens/s per rank and for all ranks, the
ratios to plain ``generate`` (time and tokens/s per rank), root forwards, all-gather calls and MB per ``generate``
(rank 0, whole buffers: hybridzero's comm ledger, FSDP2's c10d counter, DeepSpeed's comms logger), and whether rank
0's tokens equal plain generation's on the same prompts. Written to ``<out>/generate.json`` and ``generate.md``.
Nothing here asserts a time.

Reading the numbers: with W ranks on W cores each rank has a core, but gloo's all-gathers are CPU copies that
compete with compute; the per-token cost of ZeRO-3 generation is dominated by gathering every parameter once per
decoding step, which is why DeepSpeed-Chat's hybrid engine exists.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing
sys.path.insert(0, str(HERE))

from bench_model import benchmark_config, prefetch_bucket_for
from generate_common import (
    ForwardCounter,
    greedy_generate,
    load_model,
    prompts_for,
    ranks_row,
    summarize,
    timed_calls,
)
from peer_common import MODEL_CHOICES, deepspeed_available

from hybridzero.runtime.hybrid import gathered_bytes
from tests.harness.spawn import WorldPool

SYSTEMS: tuple[str, ...] = (
    "plain",
    "plain-ranks",
    "hybrid",
    "hybrid-tp",
    "zero3",
    "zero3-noprefetch",
    "fsdp2",
    "deepspeed",
)
"""``--systems`` choices, in the order they run (``plain`` always runs: it is the reference)."""
NAMES: dict[str, str] = {
    "plain": "plain generate (unsharded)",
    "hybrid": "hybrid engine",
    "hybrid-tp": "hybrid engine, tensor-parallel",
    "plain-ranks": "plain generate, W unsharded copies at once",
    "zero3": "zero3 (prefetch on)",
    "zero3-noprefetch": "zero3 (prefetch off)",
    "fsdp2": "fsdp2 (unshard, generate)",
    "deepspeed": "deepspeed zero3 (synced_gpus)",
}


def plain_rank(settings: dict[str, Any]) -> dict[str, Any]:
    """One of W processes each generating on its own unsharded copy at the same time (no engine, no collective):
    the per-rank compute floor under the same CPU and memory-bandwidth sharing as the W-rank systems."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    model = load_model(settings["model"])
    prompts = prompts_for(rank, settings["batch"], settings["prompt_len"], int(model.config.vocab_size))
    seconds, out = timed_calls(lambda: greedy_generate(model, prompts, settings["new_tokens"]), settings["repeats"])
    return {"seconds": seconds, "tokens": out if rank == 0 else None}


def zero3_rank(settings: dict[str, Any], prefetch: bool, hybrid: bool = False, tp: int = 1) -> dict[str, Any]:
    """One hybridzero ZeRO-3 rank: warm-up, then timed ``generate`` calls; per-call seconds, ledger counts, rank 0's
    tokens. ``hybrid``: through ``engine.generate`` (hybrid engine) instead of ``engine.module.generate``; ``tp`` >
    1: tensor-parallel generation over groups of ``tp`` ranks."""
    import hybridzero

    hybridzero.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = load_model(settings["model"])
    bucket = prefetch_bucket_for(settings["model"]) if prefetch else 0
    config = benchmark_config(world, prefetch_bucket_size=bucket)
    del config["optimizer"]  # inference only: no optimizer state
    if tp > 1:
        config["hybrid_engine"] = {"inference_tp_size": tp}
    engine, *_ = hybridzero.initialize(model=model, config=config)
    engine.eval()
    prompts = prompts_for(rank, settings["batch"], settings["prompt_len"], int(model.config.vocab_size))
    target = engine if hybrid else engine.module
    forwards = ForwardCounter(engine.module)
    seconds, out = timed_calls(
        lambda: greedy_generate(target, prompts, settings["new_tokens"]),
        settings["repeats"],
        forwards,
        engine.comm_ledger().reset,
    )
    forwards.remove()
    engine.assert_quiescent()
    gathers = engine.comm_ledger().total(collective="all_gather")
    stats = engine.tp_generator.last_stats if engine.tp_generator is not None else None
    held = stats.held_bytes if stats is not None else gathered_bytes(engine.coordinator) if hybrid else None
    return {
        "seconds": seconds,
        "forwards": forwards.count,
        "gather_calls": gathers.calls,
        "gather_bytes": gathers.bytes,
        "held_bytes": held,
        "tokens": out if rank == 0 else None,
    }


def plain_run(settings: dict[str, Any]) -> dict[str, Any]:
    """Plain ``generate`` of rank 0's prompts on the unsharded model in this process (one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = load_model(settings["model"])
        prompts = prompts_for(0, settings["batch"], settings["prompt_len"], int(model.config.vocab_size))
        seconds, out = timed_calls(lambda: greedy_generate(model, prompts, settings["new_tokens"]), settings["repeats"])
        n_params = sum(p.numel() for p in model.parameters())
        return {"seconds": seconds, "tokens": out, "n_params": n_params}
    finally:
        torch.set_num_threads(threads)


def sharded_rows(settings: dict[str, Any], systems: list[str], plain_tokens: torch.Tensor) -> list[dict[str, Any]]:
    """Run the requested multi-rank systems (DeepSpeed in a pool of its own, last) and summarise each."""
    rows = []
    timeout = settings["timeout"]
    ours = [s for s in systems if s in ("plain-ranks", "hybrid", "hybrid-tp", "zero3", "zero3-noprefetch", "fsdp2")]
    if ours:
        with WorldPool(settings["world"]) as pool:
            for system in ours:
                if system == "fsdp2":
                    from generate_peers import fsdp2_rank

                    ranks = pool.run(fsdp2_rank, settings, timeout=timeout)
                elif system == "plain-ranks":
                    ranks = pool.run(plain_rank, settings, timeout=timeout)
                else:
                    hybrid, tp = system.startswith("hybrid"), settings["tp"] if system == "hybrid-tp" else 1
                    ranks = pool.run(zero3_rank, settings, system != "zero3-noprefetch", hybrid, tp, timeout=timeout)
                rows.append(ranks_row(NAMES[system], ranks, settings, plain_tokens))
    if "deepspeed" in systems:
        from generate_peers import deepspeed_rank

        with WorldPool(settings["world"], env={"DS_ACCELERATOR": "cpu", "DS_BUILD_OPS": "0"}) as pool:
            ranks = pool.run(deepspeed_rank, settings, timeout=timeout)
        rows.append(ranks_row(NAMES["deepspeed"], ranks, settings, plain_tokens))
    return rows


def _cell(row: dict[str, Any], key: str, fmt: str) -> str:
    """``row[key]`` formatted, or a dash where the system has no such number."""
    value = row.get(key)
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return format(value, fmt)


_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("system", "system", ""),
    ("W", "world_size", "d"),
    ("median s/generate", "median_s", ".3f"),
    ("min s", "min_s", ".3f"),
    ("max s", "max_s", ".3f"),
    ("time ×plain", "time_vs_plain", ".2f"),
    ("new tok/s per rank", "tokens_per_s_per_rank", ".0f"),
    ("tok/s ×plain", "tokens_per_s_vs_plain", ".2f"),
    ("new tok/s all ranks", "tokens_per_s_all_ranks", ".0f"),
    ("forwards", "forwards", "d"),
    ("all-gather calls", "all_gather_calls", "d"),
    ("all-gather MB", "all_gather_mb", ".1f"),
    ("params held MB", "held_mb", ".2f"),
    ("tokens = plain", "tokens_match_plain", ""),
)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table."""
    lines = [
        "| " + " | ".join(title for title, _, _ in _COLUMNS) + " |",
        "|---|" + "---:|" * (len(_COLUMNS) - 2) + "---|",
    ]
    lines += ["| " + " | ".join(_cell(row, key, fmt) for _, key, fmt in _COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def metadata(settings: dict[str, Any], n_params: int) -> dict[str, Any]:
    """Date, machine, versions, commit and settings of this run."""

    def version(package: str) -> str | None:
        """The installed version of ``package`` (``None`` if absent)."""
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    try:
        commit = (
            subprocess.run(
                ["git", "-C", str(HERE.parent), "rev-parse", "HEAD"],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "versions": {p: version(p) for p in ("torch", "transformers", "hybridzero", "deepspeed")},
        "git_commit": commit,
        "settings": {
            **settings,
            "n_params": n_params,
            "threads_per_process": 1,
            "kv_cache": True,
            "decoding": "greedy",
            "bytes": "whole-buffer bytes from rank 0's comm ledger",
        },
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2, help="ranks of every sharded system")
    p.add_argument("--batch", type=int, default=8, help="prompts per rank (and for plain generate)")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed generate calls after one warm-up")
    p.add_argument("--tp", type=int, default=2, help="inference_tp_size of the hybrid-tp system (divides --world)")
    p.add_argument("--model", choices=MODEL_CHOICES, default="bench", help="benchmark model variant")
    p.add_argument("--tiny", dest="model", action="store_const", const="tiny", help="alias of --model tiny")
    p.add_argument(
        "--systems", choices=SYSTEMS, nargs="+", default=list(SYSTEMS), help="systems to run (plain always runs)"
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed for each sharded run")
    p.add_argument("--out", type=Path, default=HERE / "results", help="output directory")
    args = p.parse_args(argv)
    if min(args.world, args.batch, args.prompt_len, args.new_tokens, args.repeats) < 1:
        p.error("--world, --batch, --prompt-len, --new-tokens and --repeats must all be >= 1")
    if args.tp < 1 or args.world % args.tp:
        p.error(f"--tp {args.tp} must be >= 1 and divide --world {args.world}")
    return args


def main(argv: list[str] | None = None) -> None:
    """Run the systems, print the table, write ``generate.json`` and ``generate.md``."""
    args = parse_args(argv)
    settings = {
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "model": args.model,
        "tiny": args.model == "tiny",
        "timeout": args.timeout,
        "world": args.world,
        "tp": args.tp,
    }
    systems = [s for s in SYSTEMS if s in args.systems]
    skipped: dict[str, str] = {}
    if "deepspeed" in systems and not deepspeed_available():
        skipped["deepspeed"] = "deepspeed is not importable (install with: DS_BUILD_OPS=0 pip install '.[bench]')"
        print(f"NOTE: DeepSpeed skipped: {skipped['deepspeed']}", flush=True)
        systems.remove("deepspeed")
    plain = plain_run(settings)
    rows = [summarize(NAMES["plain"], 1, plain["seconds"], settings)]
    rows += sharded_rows(settings, systems, plain["tokens"])
    for row in rows:
        row["time_vs_plain"] = row["median_s"] / rows[0]["median_s"]
        row["tokens_per_s_vs_plain"] = row["tokens_per_s_per_rank"] / rows[0]["tokens_per_s_per_rank"]
    table = markdown_table(rows)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = metadata(settings, plain["n_params"])
    record = {"metadata": {**meta, "systems": systems, "skipped": skipped}, "results": rows, "table": table}
    (args.out / "generate.json").write_text(json.dumps(record, indent=2) + "\n")
    notes = "".join(f"\n\n{name} skipped: {why}" for name, why in skipped.items())
    (args.out / "generate.md").write_text(
        f"# generation on sharded parameters vs plain generate ({meta['date']})\n\n"
        f"model {args.model} ({plain['n_params'] / 1e6:.2f} M params), W={args.world}, batch {args.batch}, prompt "
        f"{args.prompt_len}, {args.new_tokens} new tokens, greedy, fp32, {args.repeats} timed calls.\n\n"
        f"{table}{notes}\n"
    )
    print(f"wrote {args.out / 'generate.json'}")


if __name__ == "__main__":
    main()

"""ZeRO-3 generation without a hybrid engine (``engine.module.generate``) against plain ``generate`` (CPU, gloo).

    python bench/bench_generate.py [--world 2] [--batch 8] [--prompt-len 16] [--new-tokens 64] [--repeats 3]
                                   [--tiny] [--out bench/results]

The benchmark model (:func:`hybridzero.bench_model.benchmark_llama`) generates greedily, exactly ``--new-tokens``
tokens (``min_new_tokens`` = ``max_new_tokens``, so nobody stops early) for ``--batch`` prompts of ``--prompt-len``
random tokens, with the KV cache on:

* ``zero3``: ``--world`` ranks (a :class:`~hybridzero.testing.spawn.WorldPool`, one thread each), one inference-only
  ZeRO-3 engine per rank with the benchmark's prefetch bucket (and once with prefetch off); every rank generates its
  own batch, so every decoding step all-gathers the whole model once (HF's synced generation).
* ``plain``: the unsharded model in this process, one thread, one batch: the compute floor of one rank.

Per system: median / min / max seconds per ``generate`` over ``--repeats`` timed calls after one warm-up (a ZeRO-3
call's time is its slowest rank's), new tokens/s per rank and for all ranks, root forwards, all-gather calls and
MB per ``generate`` (rank 0's comm ledger, whole buffers), and whether rank 0's tokens equal plain generation on the
same prompts. Written to ``<out>/generate.json`` and printed as a table. Nothing here asserts a time.

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
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing

from hybridzero.bench_model import benchmark_config, benchmark_llama, tiny_overrides  # noqa: E402
from hybridzero.testing.spawn import WorldPool  # noqa: E402

MB = 1e6


def _model(tiny: bool) -> torch.nn.Module:
    """The benchmark Llama (or its tiny variant), seed 0, in eval mode."""
    model = benchmark_llama(0, **(tiny_overrides() if tiny else {}))
    model.eval()
    return model


def prompts_for(rank: int, batch: int, prompt_len: int, vocab: int) -> torch.Tensor:
    """Random prompt ids ``[batch, prompt_len]`` of ``rank`` (private generator; avoids the special ids 0-2)."""
    generator = torch.Generator().manual_seed(1234 + rank)
    return torch.randint(3, vocab, (batch, prompt_len), generator=generator, dtype=torch.int64)


def _generate(model: torch.nn.Module, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy, KV-cached generation of exactly ``new_tokens`` tokens."""
    with torch.no_grad():
        return model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=0)


def _hybrid_generate(engine: Any, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """The hybrid engine: the same greedy generation on parameters gathered once."""
    with torch.no_grad():
        return engine.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=0)


def zero3_rank(settings: dict[str, Any], prefetch: bool, hybrid: bool = False) -> dict[str, Any]:
    """One ZeRO-3 rank: warm-up, then timed ``generate`` calls; per-call seconds, ledger counts, rank 0's tokens.
    ``hybrid``: through ``engine.generate`` (hybrid engine) instead of ``engine.module.generate``."""
    import hybridzero

    hybridzero.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = _model(settings["tiny"])
    config = benchmark_config(world, **({} if prefetch else {"prefetch_bucket_size": 0}))
    del config["optimizer"]  # inference only: no optimizer state
    engine, *_ = hybridzero.initialize(model=model, config=config)
    engine.eval()
    prompts = prompts_for(rank, settings["batch"], settings["prompt_len"], int(model.config.vocab_size))
    forwards = [0]

    def count(module: torch.nn.Module, args: Any, output: Any) -> None:
        """Forward hook on the root: one more model forward."""
        forwards[0] += 1

    handle = engine.module.register_forward_hook(count)

    def run() -> torch.Tensor:
        if hybrid:
            return _hybrid_generate(engine, prompts, settings["new_tokens"])
        return _generate(engine.module, prompts, settings["new_tokens"])

    out = run()  # warm-up
    seconds = []
    for _ in range(settings["repeats"]):
        torch.distributed.barrier()
        forwards[0] = 0
        engine.comm_ledger().reset()
        start = time.perf_counter()
        out = run()
        seconds.append(time.perf_counter() - start)
    handle.remove()
    engine.assert_quiescent()
    gathers = engine.comm_ledger().total(collective="all_gather")
    return {"seconds": seconds, "forwards": forwards[0], "gather_calls": gathers.calls,
            "gather_bytes": gathers.bytes, "tokens": out if rank == 0 else None}


def plain_run(settings: dict[str, Any]) -> dict[str, Any]:
    """Plain ``generate`` of rank 0's prompts on the unsharded model in this process (one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = _model(settings["tiny"])
        prompts = prompts_for(0, settings["batch"], settings["prompt_len"], int(model.config.vocab_size))
        out = _generate(model, prompts, settings["new_tokens"])  # warm-up
        seconds = []
        for _ in range(settings["repeats"]):
            start = time.perf_counter()
            out = _generate(model, prompts, settings["new_tokens"])
            seconds.append(time.perf_counter() - start)
        n_params = sum(p.numel() for p in model.parameters())
        return {"seconds": seconds, "tokens": out, "n_params": n_params}
    finally:
        torch.set_num_threads(threads)


def summarize(system: str, world: int, per_call: list[float], settings: dict[str, Any]) -> dict[str, Any]:
    """One result row from the per-call seconds (already the slowest rank's for ZeRO-3)."""
    median = statistics.median(per_call)
    per_rank = settings["batch"] * settings["new_tokens"] / median
    return {"system": system, "world_size": world, "median_s": median, "min_s": min(per_call), "max_s": max(per_call),
            "seconds": per_call, "tokens_per_s_per_rank": per_rank, "tokens_per_s_all_ranks": per_rank * world}


def zero3_row(pool: WorldPool, settings: dict[str, Any], prefetch: bool, plain_tokens: torch.Tensor,
              hybrid: bool = False) -> dict[str, Any]:
    """Run the ZeRO-3 ranks and summarise them (rank 0's ledger; time per call = slowest rank)."""
    ranks = pool.run(zero3_rank, settings, prefetch, hybrid, timeout=settings["timeout"])
    per_call = [max(r["seconds"][i] for r in ranks) for i in range(settings["repeats"])]
    name = "hybrid engine" if hybrid else ("zero3 (prefetch on)" if prefetch else "zero3 (prefetch off)")
    row = summarize(name, pool.world_size, per_call, settings)
    row.update(forwards=ranks[0]["forwards"], all_gather_calls=ranks[0]["gather_calls"],
               all_gather_mb=ranks[0]["gather_bytes"] / MB,
               tokens_match_plain=bool(torch.equal(ranks[0]["tokens"], plain_tokens)))
    return row


def _cell(row: dict[str, Any], key: str, fmt: str) -> str:
    """``row[key]`` formatted, or a dash where the system has no such number."""
    value = row.get(key)
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return format(value, fmt)


_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("system", "system", ""), ("W", "world_size", "d"), ("median s/generate", "median_s", ".3f"),
    ("min s", "min_s", ".3f"), ("max s", "max_s", ".3f"), ("time ×plain", "time_vs_plain", ".2f"),
    ("new tok/s per rank", "tokens_per_s_per_rank", ".0f"), ("new tok/s all ranks", "tokens_per_s_all_ranks", ".0f"),
    ("forwards", "forwards", "d"), ("all-gather calls", "all_gather_calls", "d"),
    ("all-gather MB", "all_gather_mb", ".1f"),
    ("tokens = plain", "tokens_match_plain", ""),
)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table."""
    lines = ["| " + " | ".join(title for title, _, _ in _COLUMNS) + " |",
             "|---|" + "---:|" * (len(_COLUMNS) - 2) + "---|"]
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
        commit = subprocess.run(["git", "-C", str(HERE.parent), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=30, check=False).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                        "python": platform.python_version()},
            "versions": {p: version(p) for p in ("torch", "transformers", "hybridzero")}, "git_commit": commit,
            "settings": {**settings, "n_params": n_params, "threads_per_process": 1, "kv_cache": True,
                         "decoding": "greedy", "bytes": "whole-buffer bytes from rank 0's comm ledger"}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2, help="ZeRO-3 ranks")
    p.add_argument("--batch", type=int, default=8, help="prompts per rank (and for plain generate)")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed generate calls after one warm-up")
    p.add_argument("--tiny", action="store_true", help="the tiny model variant (smoke runs)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed for each ZeRO-3 run")
    p.add_argument("--out", type=Path, default=HERE / "results", help="output directory")
    args = p.parse_args(argv)
    if min(args.world, args.batch, args.prompt_len, args.new_tokens, args.repeats) < 1:
        p.error("--world, --batch, --prompt-len, --new-tokens and --repeats must all be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    """Run both systems, print the table, write ``generate.json``."""
    args = parse_args(argv)
    settings = {"batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                "repeats": args.repeats, "tiny": args.tiny, "timeout": args.timeout, "world": args.world}
    plain = plain_run(settings)
    rows = [summarize("plain generate (unsharded)", 1, plain["seconds"], settings)]
    rows[0]["time_vs_plain"] = 1.0
    with WorldPool(args.world) as pool:
        rows.append(zero3_row(pool, settings, True, plain["tokens"], hybrid=True))
        for prefetch in (True, False):
            rows.append(zero3_row(pool, settings, prefetch, plain["tokens"]))
    for row in rows[1:]:
        row["time_vs_plain"] = row["median_s"] / rows[0]["median_s"]
    table = markdown_table(rows)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"metadata": metadata(settings, plain["n_params"]), "results": rows, "table": table}
    (args.out / "generate.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out / 'generate.json'}")


if __name__ == "__main__":
    main()

"""ZeRO-Offload / ZeRO-Infinity on this machine: peak RSS against a memory budget, step time, swap I/O per step.

    python bench/bench_offload.py [--steps 4] [--layers 6] [--out bench/results]

One process per system (world 1, fp32, AdamW), each a fresh interpreter so its peak RSS is its own. The model is
built on the meta device and materialized group by group, so construction never holds a whole fp32 copy. The
budget is set just below the fp32 master + Adam state (11.5 of its 12 bytes per parameter): a run
without offload must exceed it (master, gradient and Adam state are 16 bytes per parameter, plus the bf16 gathered
parameters), a run with ``offload_optimizer: nvme`` (fp32 master and Adam state in swap files, streamed
``sub_group_size`` elements at a time; the fp32 gradient shard and the kept bf16 compute shard, 6 bytes per
parameter, stay in memory) must stay below it; ``offload_param: nvme`` moves the compute shard to a file too (4
bytes per parameter left: the gradient shard). bf16 compute, one short sequence per step, so activations stay small
next to the model states. RSS growth is peak RSS minus the RSS after imports (construction included: the masters are
materialized in memory, group by group, before they go to the files); steady RSS is the RSS after the last step.
Swap bytes per step are averaged over all steps (the first step only writes the optimizer state). DeepSpeed's
CPU-offload run of the same model is added when DeepSpeed is importable (an optional bench extra); otherwise its
row says so. Writes ``offload.json`` and ``offload.md``; never asserts a
time.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS: dict[str, dict[str, Any]] = {
    "no offload": {},
    "offload cpu": {"offload_optimizer": {"device": "cpu"}},
    "offload nvme": {
        "offload_optimizer": {"device": "nvme", "nvme_path": "<tmp>", "buffer_count": 2},
        "sub_group_size": 2_000_000,
    },
    "offload nvme + params nvme": {
        "offload_optimizer": {"device": "nvme", "nvme_path": "<tmp>", "buffer_count": 2},
        "offload_param": {"device": "nvme", "nvme_path": "<tmp>", "buffer_count": 3},
        "sub_group_size": 2_000_000,
    },
}
SEQ, MICRO = 32, 1
BUDGET_BYTES_PER_PARAM = 11.5
VOCAB = 2000  # small: the blocks, not the embeddings, hold the parameters (per-group transients stay small)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _model_config(layers: int) -> Any:
    import transformers

    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=1024,
        intermediate_size=2752,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2 * SEQ,
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="eager",
    )


def worker(system: str, steps: int, layers: int, nvme_dir: str) -> dict[str, Any]:
    """Train ``steps`` steps of ``system`` in this process; returns the measurements (one JSON line on stdout)."""
    import torch
    import transformers

    import hybridzero

    hybridzero.init_distributed()
    zero = json.loads(json.dumps(SYSTEMS[system]).replace("<tmp>", nvme_dir))
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "reduce_bucket_size": 2_000_000,
            "stage3_prefetch_bucket_size": 2_000_000,
            **zero,
        },
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    }
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(_model_config(layers))
    rss0 = _rss_bytes()  # every import done (the model class's too), nothing allocated yet
    numel = sum(p.numel() for p in model.parameters())
    engine, *_ = hybridzero.initialize(model=model, config=cfg)
    built_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # construction's high-water mark
    gen = torch.Generator().manual_seed(1)
    times, losses = [], []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen)
        start = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    steady = _rss_bytes()
    swapper = engine.swapper
    read, written = swapper.bytes_moved if swapper else (0, 0)
    report = engine.memory_report()
    engine.destroy()
    return {
        "system": system,
        "numel": numel,
        "rss_after_imports": rss0,
        "peak_rss": peak,
        "peak_growth": peak - rss0,
        "steady_growth": steady - rss0,
        "construction_growth": built_peak - rss0,
        "step_seconds": times,
        "losses": losses,
        "read_per_step": read / steps,
        "written_per_step": written / steps,
        "placement": report["placement"],
    }


def _run_one(system: str, steps: int, layers: int, nvme_dir: str) -> dict[str, Any]:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(29700 + os.getpid() % 200),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
        # a fixed mmap threshold: freed tensors go back to the OS, so peak RSS measures live memory (same for all)
        "MALLOC_MMAP_THRESHOLD_": "65536",
    }
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--worker",
            system,
            "--steps",
            str(steps),
            "--layers",
            str(layers),
            "--nvme",
            nvme_dir,
        ],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _deepspeed_row() -> dict[str, Any]:
    if importlib.util.find_spec("deepspeed") is None:
        return {"system": "DeepSpeed offload cpu", "skipped": "deepspeed is not importable (optional bench extra)"}
    return {
        "system": "DeepSpeed offload cpu",
        "skipped": "not run: DeepSpeed's CPU offload needs its compiled "
        "CPUAdam op and an accelerator; run bench/peer_deepspeed.py where it can",
    }


def table(rows: list[dict[str, Any]], budget: int) -> list[str]:
    """Markdown rows: peak RSS growth against the budget, median step time, swap bytes per step."""
    lines = [
        f"Budget ({BUDGET_BYTES_PER_PARAM} B/param, below fp32 master + Adam = 12 B/param): "
        f"**{budget / 2**20:.0f} MiB** of RSS growth",
        "",
        "| system | peak RSS growth MiB | within budget | of it construction MiB | steady RSS growth MiB "
        "| median step s | read MiB/step | written MiB/step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['system']} | – | – | – | – | – | – | – ({r['skipped']}) |")
            continue
        med = statistics.median(r["step_seconds"][1:] or r["step_seconds"])
        within = "yes" if r["peak_growth"] < budget else "no"
        lines.append(
            f"| {r['system']} | {r['peak_growth'] / 2**20:.0f} | {within} | {r['construction_growth'] / 2**20:.0f}"
            f" | {r['steady_growth'] / 2**20:.0f}"
            f" | {med:.2f} | {r['read_per_step'] / 2**20:.1f} | {r['written_per_step'] / 2**20:.1f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    """Run every system in its own process, print and write the table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--worker", choices=sorted(SYSTEMS), help=argparse.SUPPRESS)
    p.add_argument("--nvme", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 1 or args.layers < 1:
        p.error("--steps and --layers must be >= 1")
    if args.worker:
        print(json.dumps(worker(args.worker, args.steps, args.layers, args.nvme)))
        return
    with tempfile.TemporaryDirectory(prefix="bench-offload-") as nvme:
        rows = [_run_one(name, args.steps, args.layers, nvme) for name in SYSTEMS]
    rows.append(_deepspeed_row())
    budget = int(BUDGET_BYTES_PER_PARAM * rows[0]["numel"])
    lines = table(rows, budget)
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": datetime.now(timezone.utc).isoformat(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "budget_bytes": budget,
        "steps": args.steps,
        "layers": args.layers,
    }
    (args.out / "offload.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (args.out / "offload.md").write_text("# Offload benchmark\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

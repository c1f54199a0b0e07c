"""Per-call cost of a reward function: in-process, in the persistent worker, and forked per call.

The process holds torch and a model (``--params`` float32 parameters, written once so its pages are real), as a
trainer would; the function is the demo's cheap ``exact_answer`` on a batch of ``--batch`` completions. Also
reports how much of the parent's memory a worker ends up owning when it was forked *after* the model existed and
the parent then rewrote the model (copy-on-write; Linux ``/proc`` only).

    .venv/bin/python bench/bench_reward_calls.py --calls 200 --params 10_000_000
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from hybridzero.rlhf.demo.rewards import exact_answer
from hybridzero.rlhf.rewards.functions import call_reward_function
from hybridzero.rlhf.rewards.isolation import RewardWorker


def _ms_per_call(calls: int, timeout: float, worker: RewardWorker | None = None) -> float:
    prompts = ["1 2 = 3 ="] * BATCH
    completions = ["1 5", "1 6"] * (BATCH // 2)
    ids = [[5, 6, 2]] * BATCH
    columns = {"answer": ["1 5"] * BATCH}
    start = time.perf_counter()
    for _ in range(calls):
        call_reward_function(exact_answer, prompts, completions, ids, columns, timeout=timeout, worker=worker)
    return (time.perf_counter() - start) / calls * 1e3


def _private_mb(pid: int) -> float:
    """Memory only ``pid`` holds (``Private_Dirty`` of ``/proc/pid/smaps_rollup``), in MB."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Private_Dirty:"):
            return int(line.split()[1]) / 1024
    return float("nan")


BATCH = 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--params", type=int, default=10_000_000)
    args = parser.parse_args()
    model = torch.nn.Linear(args.params // 1000, 1000, bias=False)
    with torch.no_grad():
        model.weight.normal_()
    with RewardWorker([exact_answer]) as worker:
        worker.start()
        _ms_per_call(5, timeout=30.0, worker=worker)  # warm
        rows = {
            "in-process": _ms_per_call(args.calls, timeout=0.0),
            "persistent worker": _ms_per_call(args.calls, timeout=30.0, worker=worker),
            "fork per call": _ms_per_call(max(args.calls // 4, 10), timeout=30.0),
        }
        for name, ms in rows.items():
            print(f"{name:>18}: {ms:8.3f} ms/call  (batch {BATCH}, {args.params / 1e6:g}M params held)")
        if Path("/proc/self/smaps_rollup").exists() and worker.pid is not None:
            before = _private_mb(worker.pid)
            with torch.no_grad():
                model.weight.add_(1.0)  # the parent rewrites the model after the fork
            after = _private_mb(worker.pid)
            mb = args.params * 4 / 2**20
            print(f"worker forked after a {mb:.0f} MB model: its private memory {before:.0f} -> {after:.0f} MB")


if __name__ == "__main__":
    main()

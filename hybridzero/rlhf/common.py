"""Plumbing the RLHF trainers share: phase data, the rank's share of each global batch, reductions, run logs.

Data are dealt so that a **global** batch has the same samples at every world size: an epoch's order is one seeded
permutation of the whole dataset (the same on every rank), cut into global batches; rank ``r`` takes the ``r``-th
contiguous slice of each. Metrics are reduced over ranks (sums of per-sample numbers, then divided by global
counts), so a logged number means the same at world 1 and world 4.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from hybridzero.rlhf.data import load_records, split_for_phase

__all__ = ["DEMO_FILES", "echo_fn", "epoch_order", "global_sum", "open_runlog", "phase_records", "rank_slice",
           "steps_per_epoch"]

DEMO_FILES: Mapping[int, str] = {1: "sft.jsonl", 2: "pairs.jsonl", 3: "prompts.jsonl"}


def phase_records(paths: Sequence[str], split: str, phase: int, columns: Sequence[str] | None,
                  seed: int) -> list[dict[str, str]]:
    """The records of training ``phase`` from every dataset in ``paths`` (in order).

    ``"demo"`` is the shipped demo dataset's file for the phase (no split: its files are per phase); any other path
    goes through :func:`~hybridzero.rlhf.data.load_records` and DeepSpeed-Chat's phase split ``split``.
    """
    out: list[dict[str, str]] = []
    for path in paths:
        if path == "demo":
            from hybridzero.rlhf.demo_task import demo_data_dir

            out += load_records(demo_data_dir() / DEMO_FILES[phase], columns)
        else:
            out += split_for_phase(load_records(path, columns), split, phase, seed)
    return out


def steps_per_epoch(n_items: int, global_batch: int, what: str) -> int:
    """Whole global batches in an epoch; raises naming ``what`` when the data cannot fill even one."""
    if n_items < global_batch:
        raise ValueError(f"{what}: {n_items} record(s) cannot fill one global batch of {global_batch} "
                         "(per-device batch x world size x accumulation); lower the batch size or add data")
    return n_items // global_batch


def epoch_order(n_items: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The epoch's global order of item indices (same on every rank)."""
    order = list(range(n_items))
    if shuffle:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def rank_slice(global_indices: Sequence[int], rank: int, world: int) -> list[int]:
    """Rank ``rank``'s contiguous share of one global batch (``len`` divisible by ``world``)."""
    if len(global_indices) % world:
        raise ValueError(f"a global batch of {len(global_indices)} does not split over {world} ranks")
    per = len(global_indices) // world
    return list(global_indices[rank * per:(rank + 1) * per])


def global_sum(engine: Any, values: Sequence[float] | torch.Tensor) -> list[float]:
    """Sum ``values`` over ranks (one float64 all-reduce through the engine's counted comm)."""
    t = torch.as_tensor(values, dtype=torch.float64).reshape(-1).clone().to(engine.device)
    engine.comm.all_reduce(t, phase="metrics")
    return [float(v) for v in t.cpu()]


def echo_fn(progress: bool) -> Callable[[str], None]:
    """``tqdm.write`` when a progress bar is live (keeps the bar at the bottom), else ``print``."""
    if progress:
        from tqdm import tqdm

        return lambda line: tqdm.write(line)
    return lambda line: print(line, flush=True)


def open_runlog(output_dir: str, rank: int, tensorboard: bool, progress: bool) -> Any:
    """The step's :class:`~hybridzero.rlhf.runlog.RunLog` in ``output_dir`` (rank 0 writes, others no-op)."""
    from hybridzero.rlhf.runlog import RunLog

    return RunLog(Path(output_dir), rank, tensorboard=tensorboard, echo=echo_fn(progress))

"""Call patterns that broke ZeRO-3 elsewhere: train-mode ``no_grad`` forwards, eval forwards and ``generate``
interleaved with training, with and without activation checkpointing. Every phase ends quiescent, prefetch on and
off agree bit for bit, and checkpointing does not change a single bit."""

from __future__ import annotations

import pytest
import torch

from tests.harness.parity import RunSpec
from tests.workers.patterns import mixed_phases_run


@pytest.mark.parametrize("world_size", [2, 3])
def test_mixed_phases_prefetch_and_checkpointing_bitwise(world, world_size: int) -> None:
    pool = world(world_size)
    runs = {}
    for ckpt in (None, "non_reentrant", "reentrant"):
        for bucket in (0, 10**9):
            spec = RunSpec(model="llama", steps=3, prefetch_bucket_size=bucket)
            runs[ckpt, bucket] = pool.run(mixed_phases_run, spec, ckpt)  # asserts quiescence inside
    base = runs[None, 0]
    for key, res in runs.items():
        assert [r["losses"] for r in res] == [r["losses"] for r in base], key
        for name, value in base[0]["params"].items():
            assert torch.equal(res[0]["params"][name], value), (key, name)
        for a, b in zip(res, base):
            assert all(torch.equal(x, y) for x, y in zip(a["generated"], b["generated"])), key
    assert all(r["invalidations"] == 0 for r in runs[None, 10**9])

"""ZeRO++ hpZ: the secondary shard is a cache of the primary that is never stale, so hpZ on or off gives
bitwise-identical losses, gradients and parameters — through accumulation, an fp16 overflow, activation
checkpointing, a no_grad forward, a GatheredParameters edit, save + load, persisted, tiny and frozen parameters."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridzero.testing.hpz import hpz_run
from hybridzero.testing.parity import RunSpec
from hybridzero.testing.spawn import RemoteError

SPEC = RunSpec(model="gpt2_tied", steps=8, accumulation=3, dtype="fp16", lr=1e-3, clipping=1.0, with_scalar=True,
               persistence_threshold=40, frozen=("wpe",), inf_at=((1, 1),), edit=("model.transformer.h.1.mlp.c_fc.weight",),
               fp16={"initial_scale_power": 8}, prefetch_bucket_size=10**9)
LAYOUTS = {"2x2": ({"LOCAL_WORLD_SIZE": "2"}, [1, 2]), "1x4": ({}, [1, 2, 4])}


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", ["non_reentrant", "reentrant"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_hpz_sizes_are_bitwise_identical(world, tmp_path: Path, layout: str, checkpointing: str) -> None:
    env, sizes = LAYOUTS[layout]
    pool = world(4, env=env)
    runs = {}
    for h in sizes:
        spec = SPEC.replace(extra_zero={"zero_hpz_partition_size": h})
        runs[h] = pool.run(hpz_run, spec, checkpointing, str(tmp_path / f"h{h}"), timeout=300)
    base = runs[1]
    for h, res in runs.items():
        assert [r["losses"] for r in res] == [r["losses"] for r in base], h
        for key in ("grads", "params"):
            for name, value in base[0][key].items():
                assert torch.equal(res[0][key][name], value), (h, key, name)
        assert all(all(r["checks"]) for r in res)
        if h > 1:
            assert all(r["bwd_world_gather"] == 0 and r["bwd_hpz_gather"] > 0 for r in res), h
        else:
            assert all(r["bwd_world_gather"] > 0 for r in res)


def test_hpz_size_must_fit_world_and_node(world) -> None:
    spec = RunSpec(model="opt", steps=1)
    with pytest.raises(RemoteError) as info:
        world(4, env={"LOCAL_WORLD_SIZE": "2"}).run(hpz_run, spec.replace(
            extra_zero={"zero_hpz_partition_size": 4}, edit=("model.decoder.final_layer_norm.weight",)), "none")
    assert "zero_hpz_partition_size=4" in str(info.value) and "LOCAL_WORLD_SIZE=2" in str(info.value)
    with pytest.raises(RemoteError) as info:
        world(2).run(hpz_run, spec.replace(extra_zero={"zero_hpz_partition_size": 3}), "none")
    assert "zero_hpz_partition_size" in str(info.value) and "3" in str(info.value)

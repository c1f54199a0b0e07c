"""ZeRO++ hpZ: the secondary shard is a cache of the primary that is never stale, so hpZ on or off gives
bitwise-identical losses, gradients and parameters — through accumulation, an fp16 overflow, activation
checkpointing, a no_grad forward, a GatheredParameters edit, save + load, persisted, tiny and frozen parameters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.harness.parity import RunSpec
from tests.harness.spawn import RemoteError
from tests.workers.hpz import hpz_run

SPEC = RunSpec(
    model="gpt2_tied",
    steps=8,
    accumulation=3,
    dtype="fp16",
    lr=1e-3,
    clipping=1.0,
    with_scalar=True,
    persistence_threshold=40,
    frozen=("wpe",),
    inf_at=((1, 1),),
    edit=("model.transformer.h.1.mlp.c_fc.weight",),
    fp16={"initial_scale_power": 8},
    prefetch_bucket_size=10**9,
)
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
        world(4, env={"LOCAL_WORLD_SIZE": "2"}).run(
            hpz_run,
            spec.replace(extra_zero={"zero_hpz_partition_size": 4}, edit=("model.decoder.final_layer_norm.weight",)),
            "none",
        )
    assert "zero_hpz_partition_size=4" in str(info.value) and "LOCAL_WORLD_SIZE=2" in str(info.value)
    with pytest.raises(RemoteError) as info:
        world(2).run(hpz_run, spec.replace(extra_zero={"zero_hpz_partition_size": 3}), "none")
    assert "zero_hpz_partition_size" in str(info.value) and "3" in str(info.value)


@pytest.mark.slow
def test_two_torchrun_nodes_on_loopback(tmp_path: Path) -> None:
    """Two real ``torchrun --nnodes 2`` agents (2 ranks each): hpZ 2 is bitwise equal to hpZ off, and its backward
    gathers never use the world (cross-node) group."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "result.pt"
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node_rank",
                str(i),
                "--nproc_per_node",
                "2",
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(port),
                "-m",
                "tests.harness.two_node_main",
                str(out),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    logs = [a.communicate(timeout=400)[0] for a in agents]
    assert all(a.returncode == 0 for a in agents), "\n".join(log[-3000:] for log in logs)
    res = torch.load(out, weights_only=False)
    assert res["env"]["LOCAL_WORLD_SIZE"] == "2" and res["env"]["WORLD_SIZE"] == "4"
    off, on = res[1], res[2]
    assert off["losses"] == on["losses"] and all(on["checks"])
    for key in ("grads", "params"):
        for name, value in off[key].items():
            assert torch.equal(on[key][name], value), (key, name)
    assert on["bwd_world_gather"] == 0 < on["bwd_hpz_gather"]

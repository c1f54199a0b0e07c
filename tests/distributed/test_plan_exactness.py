"""``hybridzero plan`` is exact where it can be: at world 1-4 (and 2 nodes x 2 as torchrun's LOCAL_WORLD_SIZE
says), its model-state bytes per category equal ``memory_report()`` on every rank, and its per-step collective
calls and bytes (whole buffer and wire) equal the engine's ledger, key for key -- for stages 0-3, fp32/bf16/fp16,
prefetch and the reuse rule, hpZ, qwZ, qgZ (int8/int4), optimizer (cpu, NVMe) and parameter offload, LoRA (frozen
base groups), gradient accumulation, clipping, inference forwards, the persistent group, tied and OPT-style models --
and one hybrid-engine generation's gathers (and gathered bytes) equal the plan's."""

from __future__ import annotations

import tempfile
from typing import Any

import pytest

from tests.harness.parity import RunSpec
from tests.workers.plan import plan_cases

TWO_BY_TWO = {"LOCAL_WORLD_SIZE": "2"}
QUANT = {"zero_quantization_block_size": 64}
NO_SKIP = {"initial_scale_power": 4}  # the plan predicts applied steps; an fp16 overflow skips the step's all-gathers
NVME = {  # optimizer state in swap files (each engine makes and removes its own directory under nvme_path)
    "offload_optimizer": {"device": "nvme", "nvme_path": tempfile.gettempdir()},
    "offload_param": {"device": "cpu"},
    "sub_group_size": 3000,
}
OFFLOAD = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}

# (name, spec, also check one generation); every spec runs 3 steps: the first without a prefetch trace, then the
# steady state (trace learned, DeepSpeed's reuse rule keeps groups for the backward)
FAST: list[tuple[str, RunSpec, bool]] = [
    ("s3_fp32", RunSpec(steps=3), True),
    ("s3_bf16_prefetch_persist", RunSpec(dtype="bf16", prefetch_bucket_size=20_000, persistence_threshold=100), False),
    (
        "s3_fp16_clip_gas2",
        RunSpec(dtype="fp16", clipping=1.0, accumulation=2, reduce_bucket_size=3000, fp16=NO_SKIP),
        False,
    ),
    ("s2_bf16", RunSpec(stage=2, dtype="bf16"), False),
    ("s0_fp32_clip", RunSpec(stage=0, clipping=0.5), False),
    (
        "s3_lora",
        RunSpec(lora=("mlp", 3, True), extra_zero={"zero_quantized_nontrainable_weights": True, **QUANT}),
        True,
    ),
]
NODES: list[tuple[str, RunSpec, bool]] = [
    ("nvme_bf16", RunSpec(dtype="bf16", extra_zero=NVME), False),
    (
        "hpz_reuse0",
        RunSpec(prefetch_bucket_size=30_000, extra_zero={"zero_hpz_partition_size": 2, "stage3_max_reuse_distance": 0}),
        False,
    ),
    (
        "qwz_qgz_hpz",
        RunSpec(
            dtype="bf16",
            extra_zero={
                "zero_quantized_weights": True,
                "zero_quantized_gradients": True,
                "zero_hpz_partition_size": 2,
                "stage3_max_reuse_distance": 0,
                **QUANT,
            },
        ),
        True,
    ),
    (
        "qgz_int4_offload",
        RunSpec(
            reduce_bucket_size=4000,
            extra_zero={"zero_quantized_gradients": True, "zero_quantized_gradients_bits": 4, **QUANT, **OFFLOAD},
        ),
        False,
    ),
]
SLOW: list[tuple[str, RunSpec, bool]] = [
    ("s1_fp16", RunSpec(stage=1, dtype="fp16", fp16=NO_SKIP, extra_zero={"ignore_unused_parameters": False}), False),
    ("s0_bf16_gas2", RunSpec(stage=0, dtype="bf16", accumulation=2), False),
    ("s3_lion", RunSpec(optimizer_type="Lion", lr=1e-3), False),  # one state tensor an element
    ("s2_adagrad", RunSpec(stage=2, optimizer_type="Adagrad"), False),
    ("s2_offload", RunSpec(stage=2, extra_zero={"offload_optimizer": {"device": "cpu"}}), False),
    (
        "gpt2_tied_live",
        RunSpec(model="gpt2_tied", prefetch_bucket_size=9000, extra_zero={"stage3_max_live_parameters": 20_000}),
        True,
    ),
    ("opt_qwz", RunSpec(model="opt", dtype="bf16", extra_zero={"zero_quantized_weights": True, **QUANT}), True),
    ("s3_lora_partial", RunSpec(lora=("self_attn", 2, False), dtype="bf16", persistence_threshold=40), False),
]


def mismatches(names: list[str], per_case: list[dict[str, Any]], rank: int) -> list[str]:
    """Every difference between engine and plan in one rank's results (empty when the plan is exact)."""
    out: list[str] = []
    for name, r in zip(names, per_case):
        for step, (engine, plan) in enumerate(r["steps"]):
            if engine != plan:
                out.append(f"{name}, rank {rank}, step {step}: ledger {engine} != plan {plan}")
        report, predicted = r["memory"]
        out += [
            f"{name}, rank {rank}: {key} {report[key]} != plan {value}"
            for key, value in predicted.items()
            if report[key] != value
        ]
        for key in ("peak", "generate", "gathered_model"):
            if key in r and r[key][0] != r[key][1]:
                out.append(f"{name}, rank {rank}: {key} {r[key][0]} != plan {r[key][1]}")
        if not any(v[1] > 0 for v in r["steps"][-2][0].values()):
            out.append(f"{name}, rank {rank}: a step moved no bytes")
    return out


def _check(names: list[str], results: list[list[dict[str, Any]]]) -> None:
    found = [m for rank, per_case in enumerate(results) for m in mismatches(names, per_case, rank)]
    assert not found, "\n".join(found)


def _run(pool: Any, cases: list[tuple[str, RunSpec, bool]]) -> None:
    results = pool.run(plan_cases, [(spec, gen) for _, spec, gen in cases], timeout=300)
    _check([name for name, _, _ in cases], results)


@pytest.mark.timeout(400)
def test_plan_equals_engine_at_world_2(world) -> None:
    _run(world(2), FAST)


@pytest.mark.timeout(400)
def test_plan_equals_engine_on_two_nodes_of_two(world) -> None:
    _run(world(4, env=TWO_BY_TWO), NODES)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_plan_equals_engine_matrix(world, world_size: int) -> None:
    cases = FAST + SLOW + (NODES if world_size == 4 else [])
    env = TWO_BY_TWO if world_size == 4 else None
    _run(world(world_size, env=env), cases)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_plan_equals_engine_under_two_torchrun_agents(tmp_path) -> None:
    """2 nodes x 2 as a real launch: two ``torchrun --nnodes 2`` agents on loopback (LOCAL_WORLD_SIZE from torchrun)."""
    import os
    import socket
    import subprocess
    import sys

    import torch

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "result.pt"
    args = ["--nnodes", "2", "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port)]
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                *args,
                "--node_rank",
                str(i),
                "-m",
                "tests.harness.plan_two_node_main",
                str(out),
            ],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    logs = [a.communicate(timeout=500)[0] for a in agents]
    assert all(a.returncode == 0 for a in agents), "\n".join(log[-3000:] for log in logs)
    res = torch.load(out, weights_only=True)
    assert res["env"]["LOCAL_WORLD_SIZE"] == "2" and res["env"]["WORLD_SIZE"] == "4"
    assert res["mismatches"] == [[], [], [], []]

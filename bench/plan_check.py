"""``hybridzero plan`` checked where it cannot be exact: the tables of docs/plan.md, printed as Markdown.

    python bench/plan_check.py

1. Model-state memory per GPU next to DeepSpeed's ``estimate_zero3_model_states_mem_needs_all_cold`` (its documented
   formula, computed here: no DeepSpeed import) for a 7B and a 70B Llama at 8, 64 and 512 GPUs.
2. ZeRO's 16 Psi / N.
3. The ZeRO++ paper's cross-node volume (3 M -> 0.75 M, M = the fp16 model's bytes).
4. Step-time estimates for the benchmark runs of README's "Performance" table (measured 2026-12-02 on this 2-core
   machine) with the ``cpu`` profile. Nothing here runs a model: plans only (a few seconds).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_model import benchmark_config, benchmark_llama, overrides_100m, reduce_bucket_for
from hybridzero.plan.model import load_hf_config, meta_model
from hybridzero.plan.planner import Cluster, Workload, plan_model
from hybridzero.plan.profiles import device_profile, links_for

GIB = 2**30
# README "Performance" (bench/run_all.py, 2026-12-02): hybridzero ms per training step
MEASURED_MS = {
    ("bench", 2, "fp32", 1): 207.5,
    ("bench", 2, "bf16", 1): 128.0,
    ("bench", 4, "fp32", 1): 372.3,
    ("bench", 4, "bf16", 1): 207.9,
    ("bench", 4, "fp32", 2): 462.1,
    ("100m", 2, "fp32", 1): 3535.0,
}


def ds_zero3_cold(total: int, largest: int, gpus: int, nodes: int, offload_opt: bool, offload_param: bool) -> int:
    """GPU bytes of DeepSpeed's ``estimate_zero3_model_states_mem_needs`` (zero_init=1), from its documented rule:
    ``4 x largest_layer`` plus ``18 Psi / N`` without offload, ``2 Psi / N`` with the optimizer offloaded, nothing
    more with parameters offloaded too."""
    largest_layer_memory = 4 * largest
    if offload_opt and offload_param:
        return largest_layer_memory
    if offload_opt:
        return largest_layer_memory + int(2 * total / (gpus * nodes))
    return largest_layer_memory + int(18 * total / (gpus * nodes))


def largest_layer(model: torch.nn.Module) -> int:
    """DeepSpeed's ``largest_layer_params``: the most parameters any one module holds directly."""
    return max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())


def _raw(stage: int = 3, dtype: str = "fp16", **zero: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, **zero},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}},
        "fp16": {"enabled": dtype == "fp16"},
        "bf16": {"enabled": dtype == "bf16"},
    }


def memory_table() -> None:
    print("| model | GPUs | DeepSpeed per GPU | plan: model states | plan: gathered peak | plan total | difference |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in ("llama-7b", "llama-70b"):
        hf = load_hf_config(name)
        model = meta_model(hf)
        total, largest = sum(p.numel() for p in model.parameters()), largest_layer(model)
        for nodes in (1, 8, 64):
            for off in ("none", "cpu"):
                zero: dict[str, Any] = {}
                if off == "cpu":
                    zero = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
                plan = plan_model(
                    model,
                    hf,
                    _raw(**zero),
                    Cluster(nodes, 8, device_profile("a100-80gb"), links_for("a100-80gb")),
                    Workload(2048),
                )
                m = plan["memory"]
                states = sum(v for k, v in m["placement"]["device"].items() if k != "gathered")
                ds = ds_zero3_cold(total, largest, 8, nodes, off == "cpu", off == "cpu")
                ours = states + m["gathered_peak"]
                label = f"{name}{' (offload cpu)' if off == 'cpu' else ''}"
                print(
                    f"| {label} | {8 * nodes} | {ds / GIB:.2f} GiB | {states / GIB:.2f} GiB | "
                    f"{m['gathered_peak'] / GIB:.2f} GiB | {ours / GIB:.2f} GiB | {(ours - ds) / GIB:+.2f} GiB |"
                )
        print(f"| ({name}: Psi = {total:,}, largest layer = {largest:,}) | | | | | | |")


def sixteen_psi() -> None:
    print("| model | N | master + gradients + optimizer per rank | 16 Psi / N | ratio |")
    print("|---|---:|---:|---:|---:|")
    for name in ("llama-7b", "llama-70b"):
        hf = load_hf_config(name)
        model = meta_model(hf)
        psi = sum(p.numel() for p in model.parameters())
        for nodes in (1, 8, 64):
            cluster = Cluster(nodes, 8, device_profile("a100-80gb"), links_for("a100-80gb"))
            m = plan_model(model, hf, _raw(stage3_param_persistence_threshold=0), cluster, Workload(2048))["memory"]
            got = m["master_weights"] + m["gradients"] + m["optimizer_state"]
            want = 16 * psi / (8 * nodes)
            print(f"| {name} | {8 * nodes} | {got:,} | {want:,.0f} | {got / want:.6f} |")


def zeropp_table() -> None:
    hf = load_hf_config("llama-7b")
    model = meta_model(hf)
    big_m = 2 * sum(p.numel() for p in model.parameters())
    cluster = Cluster(4, 8, device_profile("a100-80gb"), links_for("a100-80gb"))
    base = {"stage3_max_reuse_distance": 0}
    variants = {
        "ZeRO-3": {},
        "qwZ": {"zero_quantized_weights": True},
        "hpZ 8": {"zero_hpz_partition_size": 8},
        "qgZ int4": {"zero_quantized_gradients": True, "zero_quantized_gradients_bits": 4},
        "ZeRO++ (all three)": {
            "zero_quantized_weights": True,
            "zero_hpz_partition_size": 8,
            "zero_quantized_gradients": True,
            "zero_quantized_gradients_bits": 4,
        },
    }
    print("| llama-7b, 4 nodes x 8, fp16 | forward gather | backward gather | gradient reduction | cross-node total |")
    print("|---|---:|---:|---:|---:|")
    for name, zero in variants.items():
        plan = plan_model(model, hf, _raw(**base, **zero), cluster, Workload(2048))
        parts = {"forward": 0.0, "backward": 0.0, "reduce": 0.0}
        for r in plan["collectives"]:
            if r["link"] != "inter" or r["phase"] == "step":
                continue
            key = "reduce" if r["collective"] in ("reduce_scatter", "grad_all_gather") else r["phase"]
            parts[key] += r["bytes"] / big_m
        total = sum(parts.values())
        print(
            f"| {name} | {parts['forward']:.3f} M | {parts['backward']:.3f} M | {parts['reduce']:.4f} M | "
            f"{total:.3f} M |"
        )


def step_table() -> None:
    print("| benchmark run (README) | measured ms | plan ms | plan / measured | compute | exposed comm | optimizer |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for (variant, world, dtype, hpz), measured in MEASURED_MS.items():
        overrides = overrides_100m() if variant == "100m" else {}
        with torch.device("meta"):
            model = benchmark_llama(**overrides)
        raw = benchmark_config(world, dtype=dtype, reduce_bucket_size=reduce_bucket_for(variant))
        if variant == "100m":
            raw["zero_optimization"]["stage3_prefetch_bucket_size"] = 12_600_000
        if hpz > 1:
            raw["zero_optimization"]["zero_hpz_partition_size"] = hpz
        cluster = Cluster(1, world, device_profile("cpu"), links_for("cpu"))
        t = plan_model(model, model.config, raw, cluster, Workload(64))["step_time"]
        name = f"{variant}, world {world}, {dtype}" + (f", hpZ {hpz}" if hpz > 1 else "")
        print(
            f"| {name} | {measured:.1f} | {1000 * t['total_s']:.1f} | {1000 * t['total_s'] / measured:.2f} | "
            f"{1000 * t['compute_s']:.1f} | {1000 * t['exposed_comm_s']:.1f} | {1000 * t['optimizer_s']:.1f} |"
        )


def main() -> None:
    warnings.simplefilter("ignore")
    for title, table in (
        ("Model-state memory vs DeepSpeed's estimate", memory_table),
        ("ZeRO's 16 Psi / N", sixteen_psi),
        ("ZeRO++ cross-node volume", zeropp_table),
        ("Step time vs measured", step_table),
    ):
        print(f"\n### {title}\n")
        table()


if __name__ == "__main__":
    main()

"""Assemble a plan: one model (or RLHF's four) on a cluster, as a JSON-ready dict.

A plan of one model (:func:`plan_model`) holds, per rank: the model-state bytes of every category (rank 0, which
holds the most: every group lays its trainable elements first and pads at the end), the peak gathered bytes under the
prefetch / max-live settings, activations with and without checkpointing, the host and file bytes of offload; per
optimizer step (steady state: the prefetch trace learned): every collective's calls and bytes with its link class,
totals per link class; the roofline step time; for the actor of an RLHF run, the hybrid engine's generation (gathered
bytes, KV cache, its gathers, decode time at memory bandwidth).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import transformers
from torch import nn

from hybridzero.comm.ledger import Ledger
from hybridzero.config import Config, load_config
from hybridzero.plan.layout import GroupShape, group_shapes
from hybridzero.plan.memory import (
    activation_bytes,
    gathered_model_bytes,
    kv_cache_bytes,
    model_states,
    ulysses_all_to_all_bytes,
)
from hybridzero.plan.profiles import DeviceProfile, Links
from hybridzero.plan.roofline import Flops, StepWork, link_class, step_time, transformer_flops
from hybridzero.plan.steps import StepSimulator, Topology, generation_ledger

__all__ = ["HEADROOM", "Cluster", "Workload", "config_for", "plan_model"]

HEADROOM = 0.9  # share of device memory a plan may fill (CUDA context, allocator caches, fragmentation)
_DTYPE_NAMES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``gpus_per_node`` ranks of ``device`` joined by ``links``."""

    nodes: int
    gpus_per_node: int
    device: DeviceProfile
    links: Links

    @property
    def world(self) -> int:
        """Total ranks."""
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Workload:
    """What one model does per step: train (sequences of ``seq_len``) or only infer, and what it generates."""

    seq_len: int
    checkpointing: bool = False
    train: bool = True
    generate: tuple[int, int] | None = None  # (prompt tokens, answer tokens) of hybrid-engine generation


def config_for(raw: dict[str, Any], world: int, train: bool = True) -> Config:
    """The typed config at ``world`` ranks (batch sizes resolved against it); a model that is not trained keeps its
    ZeRO stage and precision but has no optimizer and no offload (DS-Chat's reference and reward engines)."""
    raw = dict(raw)
    if not train:
        raw.pop("optimizer", None)
        raw.pop("scheduler", None)
        zero = {k: v for k, v in dict(raw.get("zero_optimization") or {}).items() if not k.startswith("offload")}
        raw["zero_optimization"] = zero
    return load_config(raw, world)


def _matmul_params(model: nn.Module) -> int:
    """Parameters used as matmuls: all but embedding lookups (an input embedding tied to the output head counts)."""
    getter = getattr(model, "get_output_embeddings", None)
    out = getter() if callable(getter) else None
    head = id(out.weight) if isinstance(out, nn.Module) else None
    seen: set[int] = set()
    lookups = 0
    for mod in model.modules():
        if isinstance(mod, nn.Embedding) and id(mod.weight) not in seen and id(mod.weight) != head:
            seen.add(id(mod.weight))
            lookups += mod.weight.numel()
    return sum(p.numel() for p in model.parameters()) - lookups


def _entries(ledger: Ledger, nodes: int) -> list[dict[str, Any]]:
    return [{**row, "link": link_class(str(row["group"]), nodes)} for row in ledger.snapshot()]


def _by_link(rows: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    out = {link: {"calls": 0, "bytes": 0, "wire_bytes": 0} for link in ("intra", "inter")}
    for row in rows:
        for k in ("calls", "bytes", "wire_bytes"):
            out[row["link"]][k] += int(row[k])
    return out


def _pcie_bytes(ledger: Ledger, cfg: Config, world: int) -> int:
    """Host<->device copies of ZeRO-Offload per step: each gathered shard up (compute dtype), each reduced gradient
    down (fp32)."""
    if cfg.zero.offload_optimizer.device == "none":
        return 0
    up = sum(e.bytes // world for k, e in ledger.items() if k.collective == "all_gather" and k.group == "world")
    down = sum(e.bytes // world for k, e in ledger.items() if k.collective == "reduce_scatter")
    return up + down * 4 // cfg.communication_dtype.itemsize


def _simulate(shapes: list[GroupShape], cfg: Config, topo: Topology, train: bool) -> tuple[Ledger, int, bool]:
    """The steady-state step's ledger (the first step learns the prefetch trace), the peak gathered bytes, and whether
    that step prefetches anything (a bucket smaller than every group prefetches nothing: no gather overlaps)."""
    sim = StepSimulator(shapes, cfg, topo)
    run = sim.train_step if train else sim.inference_forward
    run()
    first = sim.prefetched
    ledger = run()
    return ledger, sim.peak_gathered_bytes, sim.prefetched > first


def _flops(model: nn.Module, hf: transformers.PretrainedConfig, micro: int, work: Workload) -> Flops:
    """Matmul FLOPs of one micro-batch (forward only when the model does not train)."""
    heads = int(hf.num_attention_heads)
    attn_dim = heads * int(getattr(hf, "head_dim", None) or hf.hidden_size // heads)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad) if work.train else 0
    layers, tokens = int(hf.num_hidden_layers), micro * work.seq_len
    flops = transformer_flops(
        _matmul_params(model), trainable, layers, attn_dim, tokens, work.seq_len, work.checkpointing
    )
    return flops if work.train else Flops(flops.forward, 0.0, 0.0)


def _summary(cfg: Config, work: Workload) -> dict[str, Any]:
    z = cfg.zero
    return {
        "stage": z.stage,
        "dtype": _DTYPE_NAMES[str(cfg.compute_dtype)],
        "micro_batch": cfg.train_micro_batch_size_per_gpu,
        "gradient_accumulation": cfg.gradient_accumulation_steps,
        "hpz": z.hpz_partition_size,
        "qwz": z.quantized_weights,
        "qgz": z.quantized_gradients,
        "offload": z.offload_optimizer.device,
        "offload_param": z.offload_param.device,
        "checkpointing": work.checkpointing,
        "seq_len": work.seq_len,
        "sequence_parallel": cfg.sequence_parallel_size,
    }


def _memory(states: dict[str, Any], peak: int, acts: dict[bool, int], checkpointing: bool) -> dict[str, Any]:
    where = states["placement"]
    return {
        **{k: states[k] for k in ("parameters", "master_weights", "gradients", "optimizer_state")},
        "placement": where,
        "gathered_peak": peak,
        "activations": {"no_checkpointing": acts[False], "checkpointing": acts[True]},
        "device_total": sum(int(v) for v in where["device"].values()) + peak + acts[checkpointing],
        "host_total": sum(int(v) for v in where["host"].values()),
        "file_total": sum(int(v) for v in where["file"].values()),
    }


def plan_model(
    model: nn.Module, hf: transformers.PretrainedConfig, raw: dict[str, Any], cluster: Cluster, work: Workload
) -> dict[str, Any]:
    """The plan of one (meta-device) model under DeepSpeed config ``raw`` on ``cluster`` (see module docstring)."""
    world = cluster.world
    cfg = config_for(raw, world, work.train)
    shapes = group_shapes(model, cfg, world)
    topo = Topology(world, cluster.gpus_per_node)
    ledger, peak, prefetches = _simulate(shapes, cfg, topo, work.train)
    summary = _summary(cfg, work)
    item, micro = cfg.compute_dtype.itemsize, cfg.train_micro_batch_size_per_gpu
    states = model_states(shapes, cfg, 0)
    # an inference forward keeps one layer's activations at a time, as the checkpointed forward does
    sp = cfg.sequence_parallel_size  # Ulysses: activations / sp, two all-to-alls per layer each way
    acts = {ckpt: activation_bytes(hf, micro, work.seq_len, item, ckpt or not work.train, sp) for ckpt in (False, True)}
    stepped = sum(g.optimizer_numel(0) for g in shapes) if work.train and cfg.optimizer is not None else 0
    work_done = StepWork(
        flops=_flops(model, hf, micro, work),
        micro_steps=cfg.gradient_accumulation_steps if work.train else 1,
        ledger=ledger,
        group_sizes={"world": world, "hpz": cfg.zero.hpz_partition_size, "node": topo.local, "cross": topo.nodes},
        nodes=topo.nodes,
        dtype=summary["dtype"],
        prefetch=prefetches,
        overlap_reduce=cfg.zero.overlap_comm and not cfg.zero.quantized_gradients,
        stepped_elements=stepped,
        offload=cfg.zero.offload_optimizer.device,
        pcie_bytes=_pcie_bytes(ledger, cfg, world),
        state_file_bytes=int(states["optimizer_state_file"]),
    )
    t = step_time(work_done, cluster.device, cluster.links, cluster.gpus_per_node)
    rows = _entries(ledger, topo.nodes)
    plan: dict[str, Any] = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad) if work.train else 0,
        "groups": len(shapes),
        "config": summary,
        "memory": _memory(states, peak, acts, work.checkpointing),
        "collectives": rows,
        "by_link": _by_link(rows),
        "step_time": {
            "total_s": t.total,
            "compute_s": t.compute,
            "exposed_comm_s": t.exposed_comm,
            "optimizer_s": t.optimizer,
            "offload_copies_s": t.offload,
            "comm_s": t.comm,
        },
    }
    if sp > 1:
        plan["sequence_parallel"] = _sequence_parallel(hf, cfg, work, item)
    if work.generate is not None:
        plan["generation"] = _generation(shapes, cfg, topo, hf, cluster, work.generate, micro)
    return plan


def _sequence_parallel(hf: transformers.PretrainedConfig, cfg: Config, work: Workload, item: int) -> dict[str, Any]:
    """Ulysses's part of the plan: its size, the data-parallel size, and the all-to-all bytes per rank (not in the
    step-time model: the simulated ledger holds the ZeRO collectives only)."""
    sp, micro = cfg.sequence_parallel_size, cfg.train_micro_batch_size_per_gpu
    per_layer = ulysses_all_to_all_bytes(hf, micro, work.seq_len, item, sp)
    layers = int(hf.num_hidden_layers)
    passes = 2 if work.train else 1  # forward, and the backward's same exchanges
    return {
        "size": sp,
        "data_parallel_size": cfg.dp_world_size,
        "local_seq_len": -(-work.seq_len // sp),
        "all_to_alls_per_micro_step": 2 * layers * passes,
        "all_to_all_bytes_per_layer_forward": per_layer,
        "all_to_all_bytes_per_step": per_layer * layers * passes * cfg.gradient_accumulation_steps,
    }


def _generation(
    shapes: list[GroupShape],
    cfg: Config,
    topo: Topology,
    hf: transformers.PretrainedConfig,
    cluster: Cluster,
    lengths: tuple[int, int],
    batch: int,
) -> dict[str, Any]:
    """The hybrid engine's generation phase: the whole model gathered once, KV cache, decode at memory bandwidth.
    With ``hybrid_engine.inference_tp_size`` t > 1 (``runtime/tp_generate.py``, an estimate, not checked against the
    engine): the root group whole and every block's bytes / t held (projections split; norms and biases are a few
    elements), ``tp_gather_partition_size`` whole blocks gathered at a time while the slices are cut, the group's
    joint batch (t x batch rows, 1/t of the heads: the same KV bytes per rank), two all-reduces of the hidden states
    per layer and token on the t-rank group."""
    item = cfg.compute_dtype.itemsize
    tp = cfg.hybrid_engine.inference_tp_size
    gathered = gathered_model_bytes(shapes, item)
    whole = sum(g.layout.padded_numel * item for g in shapes)
    kv = kv_cache_bytes(hf, batch, sum(lengths), item)
    ledger = generation_ledger(shapes, cfg, topo)
    rows = _entries(ledger, topo.nodes)
    link = cluster.links.inter if topo.nodes > 1 else cluster.links.intra
    gather_s = sum(link.seconds(r["wire_bytes"], r["calls"] * (topo.world - 1)) for r in rows)
    tp_plan: dict[str, Any] | None = None
    if tp > 1:
        blocks = [g.layout.padded_numel * item for g in shapes if g.block]
        held = whole - sum(blocks) + sum(blocks) // tp
        peak = held + cfg.hybrid_engine.tp_gather_partition_size * max(blocks, default=0)
        layers = len(blocks)
        reduce_bytes = 2 * layers * lengths[1] * tp * batch * int(hf.hidden_size) * item
        tp_link = cluster.links.intra if tp <= topo.local else cluster.links.inter
        tp_plan = {
            "size": tp,
            "held_bytes": held,
            "peak_bytes": peak,
            "all_reduces": 2 * layers * lengths[1],
            "all_reduce_bytes": reduce_bytes,
            "all_reduce_s": tp_link.seconds(2 * reduce_bytes * (tp - 1) // tp, 2 * layers * lengths[1] * (tp - 1)),
        }
        whole = held
    decode_s = lengths[1] * (whole + kv) / (cluster.device.hbm_gbps * 1e9)
    if tp_plan is not None:
        decode_s += tp_plan["all_reduce_s"]
    return {
        "gathered_bytes": gathered if tp_plan is None else tp_plan["peak_bytes"],
        "kv_cache_bytes": kv,
        "tensor_parallel": tp_plan,
        "collectives": rows,
        "gather_s": gather_s,
        "decode_s": decode_s,
        "prompt_tokens": lengths[0],
        "answer_tokens": lengths[1],
    }

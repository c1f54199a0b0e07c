"""Per-rank bodies of the plan's exactness tests: a real engine trains a few steps while ``hybridzero plan``'s
functions predict, from a meta-device copy of the model, what it will allocate and what its ledger will record."""

from __future__ import annotations

from typing import Any

import torch

from tests.harness.parity import RunSpec, batches_for, build_model, ds_config


def _entries(ledger: Any) -> dict[tuple[str, str, str], tuple[int, int, int]]:
    return {(k.collective, k.group, k.phase): (v.calls, v.bytes, v.wire_bytes) for k, v in ledger.items()}


def plan_versus_engine(spec: RunSpec, generate: bool = False) -> dict[str, Any]:
    """Train ``spec`` on this rank's engine; return, per step (and for one ``no_grad`` forward after them), the
    engine's ledger next to the plan's prediction, the memory report next to the plan's model states (this rank), the
    peak gathered bytes of both, and (with ``generate``) one hybrid-engine generation's ledger and gathered bytes next
    to the plan's."""
    import hybridzero
    from hybridzero.comm import topology
    from hybridzero.config import load_config
    from hybridzero.plan.layout import group_shapes
    from hybridzero.plan.memory import gathered_model_bytes, model_states
    from hybridzero.plan.model import LoRAPlan, meta_model
    from hybridzero.plan.steps import StepSimulator, Topology, generation_ledger
    from hybridzero.runtime.hybrid import gathered_bytes

    hybridzero.init_distributed()
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    model = build_model(spec)
    config = ds_config(spec, world)
    cfg = load_config(config, world)
    lora = None if spec.lora is None else LoRAPlan(spec.lora[0], spec.lora[1], spec.lora[2])
    shapes = group_shapes(meta_model(model.config, lora=lora), cfg, world)
    topo = Topology(world, topology.local_world_size(world_size=world))
    sim = StepSimulator(shapes, cfg, topo)
    engine, *_ = hybridzero.initialize(model=model, config=config)
    batches = batches_for(spec, world, int(model.config.vocab_size))
    steps = []
    for s in range(spec.steps):
        mark = engine.comm_ledger().copy()
        for m in range(spec.accumulation):
            ids = batches[s, m, rank]
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        steps.append((_entries(engine.comm_ledger().since(mark)), _entries(sim.train_step())))
    mark = engine.comm_ledger().copy()
    with torch.no_grad():
        engine(input_ids=batches[0, 0, rank])  # an inference forward (experience making)
    steps.append((_entries(engine.comm_ledger().since(mark)), _entries(sim.inference_forward())))
    out: dict[str, Any] = {
        "steps": steps,
        "memory": (engine.memory_report(), model_states(shapes, cfg, rank)),
        "peak": (engine.coordinator.peak_gathered_bytes, sim.peak_gathered_bytes),
    }
    if generate:
        mark = engine.comm_ledger().copy()
        engine.generate(input_ids=batches[0, 0, rank][:, :4], max_new_tokens=3, do_sample=False)
        out["generate"] = (_entries(engine.comm_ledger().since(mark)), _entries(generation_ledger(shapes, cfg, topo)))
        item = cfg.compute_dtype.itemsize
        out["gathered_model"] = (gathered_bytes(engine.coordinator), gathered_model_bytes(shapes, item))
    engine.destroy()
    return out


def plan_cases(cases: list[tuple[RunSpec, bool]]) -> list[dict[str, Any]]:
    """:func:`plan_versus_engine` for each case, one after the other in this rank (one pool call for many)."""
    return [plan_versus_engine(spec, gen) for spec, gen in cases]

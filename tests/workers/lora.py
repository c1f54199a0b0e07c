"""Per-rank bodies of tests/distributed/test_lora.py: ZeRO-3 + DS-Chat LoRA (memory, merged generation, export)."""

from __future__ import annotations

import os
from typing import Any

import torch

from tests.harness.parity import RunSpec, batches_for, build_model, ds_config


def _engine(spec: RunSpec, **extra: Any) -> Any:
    import hybridzero

    hybridzero.init_distributed()
    model = build_model(spec)
    cfg = ds_config(spec, torch.distributed.get_world_size())
    cfg.update(extra)
    engine, *_ = hybridzero.initialize(model=model, config=cfg)
    return engine


def _train(engine: Any, spec: RunSpec, steps: range) -> list[float]:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    batches = batches_for(spec, world, int(engine.module.config.vocab_size))
    losses = []
    for s in steps:
        ids = batches[s, 0, rank]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        engine.assert_quiescent()
        losses.append(loss.item())
    return losses


def lora_memory(spec: RunSpec) -> dict[str, Any]:
    """One step; this rank's memory report and the numels the base and the adapters hold in its shards."""
    engine = _engine(spec)
    _train(engine, spec, range(1))
    trainable = sum(s.spec.numel for g in engine.groups for s in g.slots if s.trainable)
    frozen = sum(s.spec.numel for g in engine.groups for s in g.slots if not s.trainable)
    n_trainable_params = sum(1 for g in engine.groups for s in g.slots if s.trainable)
    return {
        "report": engine.memory_report(),
        "trainable": trainable,
        "frozen": frozen,
        "grad_numels": {g.name: g.grad_shard.numel() for g in engine.groups},
        "n_trainable_params": n_trainable_params,
        "grad_numel": sum(g.grad_shard.numel() for g in engine.groups),
        "master_numel": sum(g.master.numel() for g in engine.groups),
    }


def lora_generation(spec: RunSpec, dtype: str) -> dict[str, Any]:
    """Train two steps (adapters non-zero), then generate greedily merged (hybrid) and unmerged (ZeRO-3 per
    forward); check the merged weights and that the masters are bitwise what they were."""
    from hybridzero.lora import lora_delta, lora_layers

    spec = spec.replace(dtype=dtype)
    engine = _engine(spec, hybrid_engine={"enabled": True, "max_out_tokens": 64})
    _train(engine, spec, range(2))
    rank = torch.distributed.get_rank()
    prompt = batches_for(spec, torch.distributed.get_world_size(), 98)[0, 0, rank][:, :4] % 50 + 1
    masters = [g.master.clone() for g in engine.groups]
    with torch.no_grad():
        unmerged_logits = engine(input_ids=prompt).logits.float()
    engine.assert_quiescent()
    merged_ok, n_merged = True, 0
    with engine.generation_mode() as mode, torch.no_grad():
        assert mode == "full"
        for _, mod in lora_layers(engine.module):
            assert mod.merged and mod.weight.dtype == engine.compute_dtype
            n_merged += 1
        merged_logits = engine.module(input_ids=prompt).logits.float()
    engine.assert_quiescent()
    assert all(not mod.merged for _, mod in lora_layers(engine.module))
    # the merged weight is exactly (W + s R@L) rounded once to the compute dtype: check one layer in full
    name, mod = lora_layers(engine.module)[0]
    with engine.gathered_parameters([mod.weight, mod.lora_right_weight, mod.lora_left_weight]), torch.no_grad():
        expect = mod.weight.float() + lora_delta(mod.lora_right_weight, mod.lora_left_weight, mod.lora_scaling)
        expect = expect.to(engine.compute_dtype)
        delta_norm = float(lora_delta(mod.lora_right_weight, mod.lora_left_weight, mod.lora_scaling).norm())
    with engine.generation_mode(), torch.no_grad():
        full_w = engine.module.get_submodule(name).weight.clone()
    merged_ok = torch.equal(full_w, expect)
    hybrid = engine.generate(input_ids=prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    engine.assert_quiescent()
    engine.eval()
    with torch.no_grad():
        plain = engine.module.generate(
            input_ids=prompt,
            max_new_tokens=6,
            do_sample=False,
            pad_token_id=0,
            synced_gpus=torch.distributed.get_world_size() > 1,
        )
    engine.assert_quiescent()
    restored = all(torch.equal(a, g.master) for a, g in zip(masters, engine.groups))
    return {
        "hybrid": hybrid.tolist(),
        "plain": plain.tolist(),
        "restored": restored,
        "merged_ok": merged_ok,
        "n_merged": n_merged,
        "delta_norm": delta_norm,
        "logit_diff": float((merged_logits - unmerged_logits).abs().max()),
        "logit_scale": float(unmerged_logits.abs().max()),
    }


def lora_checkpoint_export(spec: RunSpec, root: str) -> dict[str, Any]:
    """Train 3 steps straight; train 2, save, resume in a fresh engine, train 1: same adapters bitwise. Rank 0
    exports merged HF weights, base weights and the peft adapters; every rank returns the LoRA model's logits."""
    from hybridzero.checkpoint.export import export_hf
    from hybridzero.checkpoint.lora_export import export_adapters

    straight = _engine(spec)
    _train(straight, spec, range(3))
    want = straight.full_parameters()
    first = _engine(spec)
    _train(first, spec, range(2))
    ckpt = os.path.join(root, "ckpt")
    first.save_checkpoint(ckpt, tag="step2")
    resumed = _engine(spec)
    resumed.load_checkpoint(ckpt, tag="step2")
    _train(resumed, spec, range(2, 3))
    got = resumed.full_parameters()
    resumed.save_checkpoint(ckpt, tag="step3")
    rank = torch.distributed.get_rank()
    if rank == 0:
        export_hf(ckpt, os.path.join(root, "merged"), "step3")
        export_hf(ckpt, os.path.join(root, "base"), "step3", lora="base")
        export_adapters(ckpt, os.path.join(root, "adapters"), "step3")
    torch.distributed.barrier()
    ids = torch.arange(1, 10).reshape(1, 9)
    resumed.eval()
    with torch.no_grad():
        logits = resumed(input_ids=ids).logits
    return {
        "resume_equal": all(torch.equal(want[n], got[n]) for n in want),
        "names": sorted(got),
        "logits": logits,
        "ids": ids,
    }


def lora_peak_gathered(spec: RunSpec) -> dict[str, Any]:
    """Peak gathered bytes of two training steps against the root group plus the largest block (with HF's
    non-reentrant activation checkpointing when ``spec.activation_checkpointing``: blocks re-run their forward inside
    the backward)."""
    import hybridzero

    hybridzero.init_distributed()
    model = build_model(spec)
    engine, *_ = hybridzero.initialize(model=model, config=ds_config(spec, torch.distributed.get_world_size()))
    losses = _train(engine, spec, range(2))
    sizes: dict[str, int] = {}  # per owner module ("" = root): a LoRA block has a trainable and a frozen group
    for g in engine.groups:
        if not g.always_full:
            sizes[g.owner or "root"] = sizes.get(g.owner or "root", 0) + g.numel * g.compute_dtype.itemsize
    params = engine.full_parameters()
    return {
        "peak": engine.coordinator.peak_gathered_bytes,
        "sizes": sizes,
        "losses": losses,
        "groups": [g.name for g in engine.groups],
        "params": params if torch.distributed.get_rank() == 0 else None,
    }

"""Per-rank bodies for the offload tests: the same run with offload off, on CPU and on NVMe, and what lives where."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch

from tests.harness.parity import RunSpec
from tests.workers.ckpt import _engine, _train, full_optimizer_state

VARIANTS = ("none", "cpu", "nvme")


def offload_block(variant: str, nvme_dir: str, param: bool = False) -> dict[str, Any]:
    """The ``zero_optimization`` keys of one variant (``sub_group_size`` small so NVMe streams several chunks);
    ``param`` adds ``offload_param`` on the same device (NVMe: compute shards in files, one read ahead)."""
    if variant == "none":
        return {}
    if variant == "param_only":  # offload_param cpu with the optimizer on the device
        return {"offload_param": {"device": "cpu"}}
    block: dict[str, Any] = {"device": variant}
    if variant == "nvme":
        block.update(nvme_path=nvme_dir, buffer_count=2)
    out: dict[str, Any] = {"offload_optimizer": block, "sub_group_size": 700}
    if param:
        out["offload_param"] = {"device": "cpu"} if variant == "cpu" else {**block, "buffer_count": 2}
    return out


def _variant_block(variant: str, nvme_dir: str) -> dict[str, Any]:
    """``"nvme+param"``: NVMe for the optimizer and the parameters; other names as :func:`offload_block`."""
    name, _, param = variant.partition("+")
    return offload_block(name, nvme_dir, param == "param")


def _resident(engine: Any) -> contextlib.AbstractContextManager[None]:
    return engine.swapper.resident() if engine.swapper is not None else contextlib.nullcontext()


def _placement_facts(engine: Any) -> dict[str, Any]:
    """The memory report next to an independent count of live tensors (per device) and of swap-file bytes."""
    report = engine.memory_report()
    host = engine.placement.host
    live_masters = [g.master for g in engine.groups]  # between steps: empty placeholders where the master is in a file
    kept = [g.compute for g in engine.groups if g.compute is not None]
    grads = [g.grad_shard for g in engine.groups]
    state = [t for st in engine.optimizer.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0]
    with _resident(engine):  # NVMe: masters read in, leaves viewing them (their sizes)
        shard_numel = sum(g.master.numel() for g in engine.groups)
        sharded_numel = sum(g.master.numel() for g in engine.groups if not g.master_is_whole)
        leaf_numel = sum(p.numel() for group in engine._leaves for p, _ in group)
    facts: dict[str, Any] = {
        "report": report,
        "host": str(host),
        "shard_numel": shard_numel,
        "sharded_numel": sharded_numel,
        "leaf_numel": leaf_numel,
        "on_host": all(t.device == host for t in live_masters + grads + state),
        "master_bytes": sum(t.numel() * t.element_size() for t in live_masters),
        "kept_bytes": sum(t.numel() * t.element_size() for t in kept),
        "kept_dtype": str(kept[0].dtype) if kept else None,
        "state_bytes": sum(t.numel() * t.element_size() for t in state),
        "file_bytes": 0,
        "swap_dir": None,
    }
    if engine.swapper is not None:
        path = engine.swapper.dir.path
        facts["swap_dir"] = str(path)
        facts["files"] = sorted(p.name for p in path.iterdir())
        facts["file_sizes"] = {p.name: os.path.getsize(p) for p in path.iterdir()}
        facts["file_bytes"] = facts["file_sizes"]["optimizer_state.bin"]
    return facts


def train_variants(
    spec: RunSpec, nvme_dir: str, variants: tuple[str, ...] = VARIANTS, param: bool = False
) -> dict[str, Any]:
    """Train ``spec`` once per variant (same data, same seed); return losses, scales, full params and state, and the
    placement facts; the swap directory must be gone after ``engine.destroy()``."""
    out: dict[str, Any] = {}
    for variant in variants:
        run = spec.replace(extra_zero={**spec.extra_zero, **offload_block(variant, nvme_dir, param)})
        engine, batches, rank = _engine(run)
        scales = []
        losses = []
        for s in range(spec.steps):
            for m in range(spec.accumulation):
                ids = batches[s, m, rank]
                loss = engine(input_ids=ids, labels=ids).loss
                if (s, rank) in spec.inf_at:
                    loss = loss * float("inf")
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            scales.append((engine.loss_scale, engine.was_step_applied()))
        engine.assert_quiescent()
        facts = _placement_facts(engine)
        with _resident(engine):
            state = full_optimizer_state(engine)
        params = engine.full_parameters()
        io = engine.swapper.bytes_moved if engine.swapper is not None else (0, 0)
        engine.destroy()
        facts["swap_dir_removed"] = facts["swap_dir"] is None or not Path(facts["swap_dir"]).exists()
        out[variant] = {
            "losses": losses,
            "scales": scales,
            "params": params if rank == 0 else None,
            "state": state if rank == 0 else None,
            "facts": facts,
            "io": io,
            "skipped": engine.skipped_steps,
        }
    return out


def save_resume(
    spec: RunSpec, ckpt: str, nvme_dir: str, save_with: str, load_with: str, save_at: int
) -> dict[str, Any]:
    """Train ``save_at`` steps with ``save_with`` offload and save; a fresh engine with ``load_with`` offload loads
    and trains to ``spec.steps``. Returns the resumed losses, full params and optimizer state."""
    first = spec.replace(extra_zero={**spec.extra_zero, **_variant_block(save_with, nvme_dir)})
    engine, batches, rank = _engine(first)
    _train(engine, batches, rank, range(save_at), spec.accumulation)
    engine.save_checkpoint(ckpt)
    engine.destroy()
    second = spec.replace(extra_zero={**spec.extra_zero, **_variant_block(load_with, nvme_dir)})
    engine, batches, rank = _engine(second)
    engine.load_checkpoint(ckpt)
    losses = _train(engine, batches, rank, range(save_at, spec.steps), spec.accumulation)
    with _resident(engine):
        state = full_optimizer_state(engine)
    params = engine.full_parameters()
    engine.destroy()
    return {"losses": losses, "params": params if rank == 0 else None, "state": state if rank == 0 else None}


def start_with_bad_nvme_path(spec: RunSpec, nvme_path: str) -> str:
    """Build an engine whose ``nvme_path`` cannot be used; returns the error's text (empty if none was raised)."""
    try:
        _engine(spec.replace(extra_zero={**spec.extra_zero, **offload_block("nvme", nvme_path)}))
    except Exception as exc:  # noqa: BLE001 -- the test checks the type and the text
        return f"{type(exc).__name__}: {exc}"
    return ""


def edit_and_train(spec: RunSpec, nvme_dir: str, variants: tuple[str, ...]) -> dict[str, Any]:
    """Per variant: one step, then rank 0 halves ``spec.edit``'s parameters inside ``zero.GatheredParameters`` with
    ``modifier_rank=0`` (with NVMe the master is read from and written back to its file, the compute shard
    re-derived), a fragment write, then the remaining steps; returns the losses and full parameters."""
    import hybridzero as deepspeed
    from hybridzero import utils

    out: dict[str, Any] = {}
    for variant in variants:
        engine, batches, rank = _engine(
            spec.replace(extra_zero={**spec.extra_zero, **_variant_block(variant, nvme_dir)})
        )
        losses = _train(engine, batches, rank, range(1), spec.accumulation)
        targets = [engine.module.get_parameter(n) for n in spec.edit]
        with deepspeed.zero.GatheredParameters(targets, modifier_rank=0), torch.no_grad():
            if rank == 0:
                for t in targets:
                    t.mul_(0.5)
        value = utils.safe_get_full_fp32_param(targets[0])
        utils.safe_set_full_fp32_param(targets[0], value + 0.25)
        losses += _train(engine, batches, rank, range(1, spec.steps), spec.accumulation)
        params = engine.full_parameters()
        engine.destroy()
        out[variant] = {"losses": losses, "params": params if rank == 0 else None}
    return out

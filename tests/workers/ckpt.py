"""Per-rank functions for checkpoint tests: interrupted vs uninterrupted runs, resharding, crashes, bad input."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from hybridzero.runtime.optim_state import leaf_ranges
from tests.harness.parity import RunSpec, batches_for, build_model, client_optimizer, ds_config


def _engine(spec: RunSpec) -> tuple[Any, torch.Tensor, int]:
    import hybridzero

    hybridzero.init_distributed()
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    model = build_model(spec)
    opt = client_optimizer(spec, model) if spec.optimizer == "client" else None
    engine, *_ = hybridzero.initialize(model=model, config=ds_config(spec, world), optimizer=opt)
    return engine, batches_for(spec, world, int(getattr(model, "config", model).vocab_size)), rank


def _train(engine: Any, batches: torch.Tensor, rank: int, steps: range, accumulation: int) -> list[float]:
    losses = []
    for s in steps:
        for m in range(accumulation):
            ids = batches[s, m, rank]
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def full_optimizer_state(engine: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter's per-element optimizer state, consolidated over ranks (a collective)."""
    keys = sorted({k for st in engine.optimizer.state.values() for k, t in st.items() if t.dim() == 1})
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key in keys:
        for g in engine.groups:
            local = torch.zeros(g.master.numel())
            for _, leaf, group, a, b in leaf_ranges(engine.optimizer, engine.groups):
                if group is g and leaf in engine.optimizer.state:
                    local[a:b] = engine.optimizer.state[leaf][key]
            if g.master_is_whole:
                flat = local
            else:
                flat = torch.empty(g.layout.padded_numel)
                engine.comm.all_gather(flat, local, phase="test")
            for slot in g.slots:
                out.setdefault(slot.spec.name, {})[key] = flat[slot.spec.offset : slot.spec.end].view(slot.spec.shape)
    return out


def run_with_checkpoint(spec: RunSpec, ckpt: str, save_at: int | None, resume: bool) -> dict[str, Any]:
    """Train ``spec.steps`` steps; optionally save after ``save_at`` steps, or load and continue from there."""
    engine, batches, rank = _engine(spec)
    if resume:
        _, client = engine.load_checkpoint(ckpt)
        start = engine.global_steps
        assert client == {"note": "step", "at": start}
        losses = _train(engine, batches, rank, range(start, spec.steps), spec.accumulation)
    else:
        upto = spec.steps if save_at is None else save_at
        losses = _train(engine, batches, rank, range(upto), spec.accumulation)
        if save_at is not None:
            engine.save_checkpoint(ckpt, client_state={"note": "step", "at": save_at})
            losses += _train(engine, batches, rank, range(save_at, spec.steps), spec.accumulation)
    engine.assert_quiescent()
    params, state = engine.full_parameters(), full_optimizer_state(engine)
    return {
        "losses": losses,
        "params": params if rank == 0 else None,
        "state": state if rank == 0 else None,
        "steps": engine.global_steps,
    }


def load_and_consolidate(spec: RunSpec, ckpt: str, tag: str | None = None) -> dict[str, Any]:
    """Load a checkpoint (any world size) and return the consolidated parameters and optimizer state."""
    engine, _, rank = _engine(spec)
    engine.load_checkpoint(ckpt, tag)
    params, state = engine.full_parameters(), full_optimizer_state(engine)
    return {
        "params": params if rank == 0 else None,
        "state": state if rank == 0 else None,
        "lr": engine.get_lr(),
        "steps": engine.global_steps,
    }


def save_then_crash(spec: RunSpec, ckpt: str) -> None:
    """Save ``tag1``, then die on rank 0 right before ``tag2`` would become visible (a test double for a kill)."""
    engine, batches, rank = _engine(spec)
    _train(engine, batches, rank, range(1), spec.accumulation)
    engine.save_checkpoint(ckpt, tag="tag1")
    _train(engine, batches, rank, range(1, 2), spec.accumulation)

    def die(*args: Any) -> None:
        os._exit(17)

    os.replace = die  # only in this doomed worker process
    engine.save_checkpoint(ckpt, tag="tag2")


def try_load(spec: RunSpec, ckpt: str, tag: str | None) -> str:
    """Load and return 'ok', 'nothing' (DeepSpeed's ``(None, None)``) or the error text."""
    engine, _, _ = _engine(spec)
    try:
        path, _ = engine.load_checkpoint(ckpt, tag)
        return "ok" if path is not None else "nothing"
    except (ValueError, FileNotFoundError, KeyError) as exc:
        return f"{type(exc).__name__}: {exc}"


def save_inside_accumulation_window(spec: RunSpec, ckpt: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """One full step, then one micro-step into the next window, save; load into a fresh engine. Both sides'
    parameters and counters (and the fresh engine's gradient norm)."""
    engine, batches, rank = _engine(spec)
    _train(engine, batches, rank, range(1), spec.accumulation)
    ids = batches[0, 0, rank]
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.save_checkpoint(ckpt)
    saved = {"params": engine.full_parameters(), "micro_steps": engine.micro_steps}
    fresh, _, _ = _engine(spec)
    fresh.load_checkpoint(ckpt)
    grads = sum(float(g.grad_shard.abs().sum()) for g in fresh.groups)
    loaded = {
        "params": fresh.full_parameters(),
        "micro_steps": fresh.micro_steps,
        "global_steps": fresh.global_steps,
        "grad_norm": grads,
    }
    return saved, loaded


def edit_json(tag_dir: str | os.PathLike[str], name: str, edit: Any) -> None:
    """Rewrite ``tag_dir/name`` (a JSON file) through ``edit(obj) -> obj`` and re-sign it in the manifest, as an
    attacker who also controls the manifest would: only the consistency checks can catch what follows."""
    file = Path(tag_dir) / name
    file.write_text(json.dumps(edit(json.loads(file.read_text()))))
    manifest_file = Path(tag_dir) / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    manifest["files"][name] = hashlib.sha256(file.read_bytes()).hexdigest()
    manifest_file.write_text(json.dumps(manifest))

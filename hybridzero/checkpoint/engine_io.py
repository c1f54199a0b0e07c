"""Save and load engine checkpoints (format: :mod:`hybridzero.checkpoint.saved`).

Invariants:
* Atomic: every rank writes into ``TAG.partial-<nonce>``; after a barrier rank 0 writes ``extra.pt`` and
  ``meta.json``, renames the directory to ``TAG`` and only then replaces ``latest``. A process killed at any point
  leaves the previous ``latest`` loadable; partial directories are never listed or loaded.
* Resharding: state is read back per parameter and element range, so a checkpoint loads at any world size, stage
  or persistence threshold; master values are written through :meth:`ShardedGroup.write_shard` (the one write
  path, so every derived copy is refreshed).
* A failed load modifies nothing: names, shapes and every shard file are checked before any state is touched.
* Saving inside a gradient-accumulation window is refused (the partial gradients are not model state).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hybridzero.checkpoint.ranges import read_range
from hybridzero.checkpoint.saved import (EXTRA, LATEST, META, PARTIAL, SavedSource, load_rank_file, rank_file,
                                         read_meta, resolve_tag)

if TYPE_CHECKING:
    from hybridzero.runtime.engine import Engine
    from hybridzero.zero.groups import ShardedGroup

LeafRange = tuple[int, torch.nn.Parameter, "ShardedGroup", int, int]  # opt group, leaf, group, [a, b) in master


def leaf_ranges(engine: "Engine") -> list[LeafRange]:
    """Every optimizer leaf with the gather group and master range it views."""
    out: list[LeafRange] = []
    for k, pairs in enumerate(engine._leaves):
        for leaf, _ in pairs:
            group = next(g for g in engine.groups
                         if g.master.untyped_storage().data_ptr() == leaf.untyped_storage().data_ptr())
            a = leaf.storage_offset() - group.master.storage_offset()
            out.append((k, leaf, group, a, a + leaf.numel()))
    return out


def aliases_of(engine: "Engine") -> dict[str, list[str]]:
    """Every name of each parameter, keyed by its first name."""
    by_id: dict[int, list[str]] = {}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return {names[0]: names for names in by_id.values()}


def _rank_payload(engine: "Engine") -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    rank = engine.comm.rank
    groups: dict[str, Any] = {}
    for g in engine.groups:
        if g.master_is_whole and rank != 0:
            continue  # identical on every rank: rank 0 keeps it
        lo, hi = (0, g.layout.padded_numel) if g.master_is_whole else g.layout.shard_range(rank)
        groups[g.name] = {"lo": lo, "hi": hi, "tensors": {"master": g.master.detach().cpu().clone()}}
    scalars: dict[int, dict[str, Any]] = {}
    state = engine.optimizer.state if engine.optimizer is not None else {}
    for k, leaf, g, a, b in leaf_ranges(engine):
        if g.name not in groups:
            continue
        part = groups[g.name]
        for key, t in state.get(leaf, {}).items():
            if isinstance(t, torch.Tensor) and t.dim() == 1 and t.numel() == leaf.numel():
                if key not in part["tensors"]:
                    part["tensors"][key] = torch.zeros(part["hi"] - part["lo"])
                part["tensors"][key][a:b].copy_(t)
            else:
                scalars.setdefault(k, {})[key] = t.item() if isinstance(t, torch.Tensor) else t
    rng = {"torch": torch.get_rng_state(), "python": random.getstate(),
           "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
    return {"rank": rank, "groups": groups, "rng": rng}, scalars


def _meta(engine: "Engine", tag: str) -> dict[str, Any]:
    aliases = aliases_of(engine)
    params = {slot.spec.name: {"group": g.name, "offset": slot.spec.offset, "numel": slot.spec.numel,
                               "shape": list(slot.spec.shape), "aliases": aliases[slot.spec.name]}
              for g in engine.groups for slot in g.slots}
    hf = getattr(engine.module, "config", None)
    return {"format": 1, "tag": tag, "world_size": engine.comm.world_size, "stage": engine.config.zero.stage,
            "global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
            "skipped_steps": engine.skipped_steps, "params": params,
            "groups": {g.name: {"padded_numel": g.layout.padded_numel, "mode": g.mode.value} for g in engine.groups},
            "optimizer": type(engine.optimizer).__name__ if engine.optimizer is not None else None,
            "hf_config": hf.to_dict() if hasattr(hf, "to_dict") else None,
            "model_class": type(engine.module).__name__}


def save(engine: "Engine", save_dir: str | os.PathLike[str], tag: str | None = None,
         client_state: dict[str, Any] | None = None, save_latest: bool = True) -> Path:
    """Write a checkpoint of ``engine`` (collective: every rank calls it); returns the tag directory."""
    if engine.micro_steps % engine.gradient_accumulation_steps != 0:
        raise ValueError(f"save_checkpoint at micro-step {engine.micro_steps} is inside a gradient-accumulation window "
                         f"of {engine.gradient_accumulation_steps}; save after the boundary step")
    engine.assert_quiescent()
    tag = tag or f"global_step{engine.global_steps}"
    root = Path(save_dir)
    nonce = engine.comm.all_gather_object(uuid.uuid4().hex if engine.comm.rank == 0 else None, phase="checkpoint")[0]
    partial = root / f"{tag}{PARTIAL}{nonce}"
    partial.mkdir(parents=True, exist_ok=True)
    payload, scalars = _rank_payload(engine)
    torch.save(payload, partial / rank_file(engine.comm.rank))
    merged: dict[int, dict[str, Any]] = {}
    for part in engine.comm.all_gather_object(scalars, phase="checkpoint"):
        for k, values in part.items():
            merged.setdefault(k, {}).update(values)
    if engine.comm.rank == 0:
        extra = {"scalars": merged, "client_state": client_state,
                 "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                  for g in (engine.optimizer.param_groups if engine.optimizer else [])],
                 "scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
                 "loss_scaler": engine.loss_scaler.state_dict()}
        torch.save(extra, partial / EXTRA)
        (partial / META).write_text(json.dumps(_meta(engine, tag), indent=1))
        final = root / tag
        old = root / f"{tag}{PARTIAL}old-{nonce}"
        if final.exists():
            os.replace(final, old)  # never a moment without a complete tag under some name
        os.replace(partial, final)
        shutil.rmtree(old, ignore_errors=True)
        if save_latest:
            tmp = root / f"{LATEST}.tmp-{nonce}"
            tmp.write_text(tag)
            os.replace(tmp, root / LATEST)
    engine.comm.barrier(phase="checkpoint")
    return root / tag


def _check_compatible(engine: "Engine", meta: dict[str, Any], path: Path) -> None:
    """Every parameter of the engine's model must be in the checkpoint with the same shape (else nothing loads)."""
    saved: dict[str, list[int]] = {}
    for info in meta["params"].values():
        for alias in info["aliases"]:
            saved[alias] = info["shape"]
    shapes = {s.spec.name: list(s.spec.shape) for g in engine.groups for s in g.slots}
    for name, names in aliases_of(engine).items():
        hit = next((n for n in names if n in saved), None)
        if hit is None:
            raise ValueError(f"checkpoint {path} has no parameter '{name}' (aliases {names}): a different model?")
        want = shapes[name]
        if saved[hit] != want:
            raise ValueError(f"parameter '{name}' has shape {want} in the model but {saved[hit]} in checkpoint {path}")


def _load_optimizer(engine: "Engine", path: Path, meta: dict[str, Any], shards: list[dict[str, Any]],
                    extra: dict[str, Any], aliases: dict[str, list[str]]) -> None:
    opt = engine.optimizer
    if opt is None:
        return
    keys = sorted({key for s in shards for part in s["groups"].values() for key in part["tensors"]} - {"master"})
    sources = {key: SavedSource(path, meta, shards, key) for key in keys}
    for k, leaf, g, a, b in leaf_ranges(engine):
        lo = 0 if g.master_is_whole else g.layout.shard_range(engine.comm.rank)[0]
        state: dict[str, Any] = {key: read_range(g.layout.specs, lo + a, lo + b, src, aliases).to(leaf.device)
                                 for key, src in sources.items()}
        on_device = any(opt.param_groups[k].get(flag) for flag in ("capturable", "fused"))
        for key, value in extra["scalars"].get(k, {}).items():
            if isinstance(value, float):  # e.g. Adam's step: a tensor, on the parameter's device when captured/fused
                value = torch.tensor(value, dtype=torch.float32, device=leaf.device if on_device else "cpu")
            state[key] = value
        if state:
            opt.state[leaf] = state
    for group, saved in zip(opt.param_groups, extra["param_groups"]):
        group.update(saved)


def load(engine: "Engine", load_dir: str | os.PathLike[str], tag: str | None = None,
         load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True) -> tuple[Path, Any]:
    """Restore ``engine`` from a checkpoint written at any world size; returns ``(tag_dir, client_state)``."""
    engine.assert_quiescent()
    path = resolve_tag(load_dir, tag)
    meta = read_meta(path)
    _check_compatible(engine, meta, path)
    shards = [load_rank_file(path, r) for r in range(meta["world_size"])]
    try:
        extra = torch.load(path / EXTRA, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"checkpoint file {path / EXTRA} is missing or corrupt: {exc}") from exc
    aliases = aliases_of(engine)
    masters = SavedSource(path, meta, shards, "master")
    values = []
    for g in engine.groups:  # read everything first: a failure leaves the engine untouched
        lo, hi = (0, g.layout.padded_numel) if g.master_is_whole else g.layout.shard_range(engine.comm.rank)
        values.append(read_range(g.layout.specs, lo, hi, masters, aliases))
    with torch.no_grad():
        for g, value in zip(engine.groups, values):
            g.master.copy_(value)
            g.write_shard()
    if load_optimizer_states:
        _load_optimizer(engine, path, meta, shards, extra, aliases)
    if load_lr_scheduler_states and engine.lr_scheduler is not None and extra["scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(extra["scheduler"])
    engine.loss_scaler.load_state_dict(extra["loss_scaler"])
    engine.global_steps, engine.micro_steps = meta["global_steps"], meta["micro_steps"]
    engine.skipped_steps = meta["skipped_steps"]
    if meta["world_size"] == engine.comm.world_size:
        rng = shards[engine.comm.rank]["rng"]
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    engine.zero_grad()
    return path, extra["client_state"]

"""The engine's checkpoint orchestration: save and verify-then-load (format and writer: :mod:`hybridzero.checkpoint`;
16-bit export: :mod:`hybridzero.runtime.weights16`).

The engine exposes its state through a narrow seam (:class:`Checkpointable`: gather groups with their masters and
one write path, optimizer, scheduler and loss scaler with ``state_dict``/``load_state_dict``, counters); this module
orchestrates, torchtitan-style, and the engine's methods only delegate here.

Invariants:
* Every failure is agreed on by all ranks with one collective before anything is published or written, so every
  rank raises the same :class:`~hybridzero.checkpoint.CheckpointError` (naming the rank, file and check) at once
  and the job stays usable (no posted failure, no hang).
* Load is verify-before-write: every file's checksum, the metadata's consistency, every tensor's shape against the
  model, optimizer/scheduler/scaler state are read and checked on every rank into staged objects; only when all
  ranks succeeded is anything written. A failed load leaves parameters, optimizer state, counters, RNG, loss
  scaler and scheduler bitwise as they were.
* Save is atomic (see :mod:`hybridzero.checkpoint.paths`): ``latest`` moves only after every rank's files are
  written and checksummed and the tag is published. Inside a gradient-accumulation window the consistent state
  is saved (parameters, optimizer state, counters as of the window's start); the partial gradients are not.

Split by phase: the seam (:class:`Checkpointable`) and the failure agreement are in
:mod:`hybridzero.runtime.checkpoint_seam`, save in :mod:`hybridzero.runtime.checkpoint_save`, the two load phases
(verify-and-stage, apply) here, the value checks of the verification phase in :mod:`hybridzero.runtime.load_checks`.
The seam's names and ``save`` are re-exported here, so ``checkpointing.save`` / ``checkpointing.Checkpointable``
keep working.
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridzero.checkpoint.ds_files import refuse_deepspeed_dir
from hybridzero.checkpoint.format import META, STATE_JSON, SavedSource, SavedTag, open_tag, rank_file
from hybridzero.checkpoint.jsontree import check_plain_json
from hybridzero.checkpoint.paths import CheckpointError, find_tag
from hybridzero.runtime import optim_state
from hybridzero.runtime.checkpoint_save import save
from hybridzero.runtime.checkpoint_seam import _PHASE, Checkpointable, agree, describe, raise_failed
from hybridzero.runtime.load_checks import check_loss_scaler, check_rng, check_state
from hybridzero.zero.fill import read_range
from hybridzero.zero.groups import ShardedGroup
from hybridzero.zero.partition import param_aliases

__all__ = ["Checkpointable", "StagedLoad", "agree", "apply_load", "describe", "prepare_load", "raise_failed", "save"]

_LOG = logging.getLogger("hybridzero")


# --- load ------------------------------------------------------------------------------------------------------
@dataclass
class StagedLoad:
    """Everything a load writes, read and checked beforehand (``None`` fields are left alone)."""

    path: Path
    masters: list[tuple[ShardedGroup, torch.Tensor]]
    client_state: Any
    optimizer: tuple[dict[torch.Tensor, dict[str, Any]], list[dict[str, Any]]] | None = None
    scheduler: dict[str, Any] | None = None
    loss_scaler: dict[str, Any] | None = None
    counters: tuple[int, int, int] | None = None
    rng: tuple[dict[str, torch.Tensor], Any] | None = None


def _missing_params(engine: Checkpointable, tag: SavedTag, strict: bool) -> set[str]:
    """Model parameters the checkpoint lacks (allowed when not ``strict`` or excluded as frozen at save);
    ValueError for a shape mismatch, or in ``strict`` mode for a missing or unexpected parameter."""
    meta, where = tag.meta, tag.path / META
    saved = {alias: info for info in meta["params"].values() for alias in info["aliases"]}
    excluded = set(meta.get("excluded", []))
    shapes = {s.spec.name: list(s.spec.shape) for g in engine.groups for s in g.slots}
    missing, used = set(), set()
    for name, names in param_aliases(engine.module).items():
        hit = next((n for n in names if n in saved), None)
        if hit is None:
            if strict and name not in excluded:
                raise ValueError(
                    f"{where}: no parameter '{name}' (aliases {names}): a different model? "
                    "(load_module_strict=False keeps the model's value)"
                )
            missing.add(name)
            continue
        used.add(id(saved[hit]))
        if saved[hit]["shape"] != shapes[name]:
            raise ValueError(
                f"{where}: parameter '{name}' has shape {shapes[name]} in the model but "
                f"{saved[hit]['shape']} in the checkpoint"
            )
    unexpected = [n for n, info in meta["params"].items() if id(info) not in used]
    if strict and unexpected:
        raise ValueError(
            f"{where}: parameters {unexpected[:5]} are not in the model (load_module_strict=False ignores them)"
        )
    return missing


def _stage(
    engine: Checkpointable, path: Path, strict: bool, load_optimizer: bool, load_scheduler: bool, module_only: bool
) -> StagedLoad:
    tag = open_tag(path)
    missing = _missing_params(engine, tag, strict)
    aliases = param_aliases(engine.module)
    masters = []
    source = SavedSource(tag, "master")
    for g in engine.groups:
        lo, hi = (0, g.layout.padded_numel) if g.master_is_whole else g.layout.shard_range(engine.comm.rank)
        base = g.master.detach().cpu().clone() if missing else None
        masters.append((g, read_range(g.layout.specs, lo, hi, source, aliases, out=base, skip=missing)))
    state = tag.state()
    check_plain_json(state["client_state"])
    staged = StagedLoad(path, masters, state["client_state"])
    if module_only:
        return staged
    where = path / STATE_JSON
    if load_optimizer and engine.optimizer is not None:
        where = Path(engine._get_optimizer_ckpt_name(path.parent, path.name))  # asked only when optimizer state loads
        staged.optimizer = optim_state.stage_optimizer_state(
            engine.optimizer.optimizer, engine.groups, engine.comm.rank, tag, state["optimizer"], aliases, missing
        )
    if load_scheduler and engine.lr_scheduler is not None:
        staged.scheduler = check_state("scheduler", state["scheduler"], engine.lr_scheduler.state_dict(), str(where))
    staged.loss_scaler = check_loss_scaler(state["loss_scaler"], engine.loss_scaler, str(where))
    m = tag.meta
    staged.counters = (m["global_steps"], m["micro_steps"], m["skipped_steps"])
    if m["world_size"] == engine.comm.world_size and m.get("rng", True):  # converted DeepSpeed tags have none
        rng, header = tag.rank_state(engine.comm.rank)
        file = path / rank_file(engine.comm.rank)
        if "rng/torch" not in rng or not isinstance(header, dict) or "python_rng" not in header:
            raise ValueError(f"{file}: RNG state missing")
        check_rng(rng, header["python_rng"], str(file))
        staged.rng = (rng, header["python_rng"])
    return staged


def prepare_load(
    engine: Checkpointable,
    load_dir: str | os.PathLike[str],
    tag: str | None = None,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
) -> StagedLoad | None:
    """Read and verify a checkpoint on every rank and agree on the outcome; None when there is nothing to load
    (no ``latest``, or no such tag: DeepSpeed's ``(None, None)`` case). Changes nothing on the engine."""
    engine.release_held()
    engine.assert_quiescent()
    staged, error = None, None
    try:
        refuse_deepspeed_dir(Path(load_dir), tag)
        path = find_tag(load_dir, tag)
        if path is not None:
            staged = _stage(
                engine, path, load_module_strict, load_optimizer_states, load_lr_scheduler_states, load_module_only
            )
    except Exception as exc:  # noqa: BLE001 - any failure while reading untrusted files is agreed on, not fatal
        error = describe(exc)
    agree(engine.comm, error, f"load_checkpoint({str(load_dir)!r}, tag={tag!r})")
    found = engine.comm.all_gather_object(staged is not None, phase=_PHASE)
    if any(found) and not all(found):
        raise CheckpointError(
            f"load_checkpoint({str(load_dir)!r}, tag={tag!r}): the checkpoint exists on ranks "
            f"{[r for r, f in enumerate(found) if f]} only (not a shared directory?)"
        )
    if staged is None and engine.comm.rank == 0:
        _LOG.warning(
            "load_checkpoint: nothing to load in %s (tag %r: no 'latest' file or no such tag directory)", load_dir, tag
        )
    return staged


def apply_load(engine: Checkpointable, staged: StagedLoad) -> tuple[str, Any]:
    """Write a staged load into the engine; returns DeepSpeed's ``(load_path, client_state)``."""
    with torch.no_grad():
        for g, value in staged.masters:
            g.master.copy_(value.to(g.master.device))
            g.write_shard()
    if staged.optimizer is not None and engine.optimizer is not None:
        optim_state.apply_optimizer_state(engine.optimizer.optimizer, *staged.optimizer)
    if staged.scheduler is not None:
        engine.lr_scheduler.load_state_dict(staged.scheduler)
    if staged.loss_scaler is not None:
        engine.loss_scaler.load_state_dict(staged.loss_scaler)
    if staged.counters is not None:
        engine.global_steps, engine.micro_steps, engine.skipped_steps = staged.counters
    if staged.rng is not None:
        tensors, python_rng = staged.rng
        torch.set_rng_state(tensors["rng/torch"])
        random.setstate(python_rng)
        cuda = [tensors[f"rng/cuda/{i}"] for i in range(sum(k.startswith("rng/cuda/") for k in tensors))]
        if cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda)
    engine.zero_grad()
    return str(staged.path), staged.client_state

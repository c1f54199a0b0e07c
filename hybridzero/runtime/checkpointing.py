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

Kept in one file for now (~460 lines): save and the two load phases share the seam and the staged-state types (the
value checks of the verification phase are in :mod:`hybridzero.runtime.load_checks`); the
natural split (save / verify-and-stage / apply) is noted in docs/architecture.md as next work.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from hybridzero.checkpoint.ds_files import refuse_deepspeed_dir
from hybridzero.checkpoint.format import FORMAT, META, STATE_JSON, SavedSource, SavedTag, open_tag, rank_file
from hybridzero.checkpoint.jsontree import check_plain_json
from hybridzero.checkpoint.paths import (
    PARTIAL,
    CheckpointError,
    check_replaceable,
    check_tag,
    find_tag,
    publish,
    write_latest,
)
from hybridzero.checkpoint.writer import write_rank_file, write_shared_files
from hybridzero.comm.collectives import Comm
from hybridzero.optim.loss_scaler import LossScaler
from hybridzero.runtime import optim_state
from hybridzero.runtime.load_checks import check_loss_scaler, check_rng, check_state
from hybridzero.zero.fill import read_range
from hybridzero.zero.groups import ShardedGroup
from hybridzero.zero.partition import param_aliases

_LOG = logging.getLogger("hybridzero")
_PHASE = "checkpoint"


class Checkpointable(Protocol):
    """What the checkpointer reads and restores on an engine."""

    comm: Comm
    module: nn.Module
    groups: list[ShardedGroup]
    optimizer: torch.optim.Optimizer | None
    lr_scheduler: Any
    loss_scaler: LossScaler
    global_steps: int
    micro_steps: int
    skipped_steps: int
    compute_dtype: torch.dtype
    config: Any

    @property
    def gradient_accumulation_steps(self) -> int: ...

    def assert_quiescent(self) -> None: ...

    def release_held(self) -> None: ...

    def zero_grad(self) -> None: ...


def agree(comm: Comm, error: str | None, what: str) -> None:
    """Raise CheckpointError on every rank if any rank reports an error (one object all-gather)."""
    raise_failed(comm.all_gather_object(error, phase=_PHASE), what)


def raise_failed(errors: list[str | None], what: str) -> None:
    """CheckpointError naming every rank's error, if any rank has one (``errors``: one entry per rank)."""
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
    if failed:
        raise CheckpointError(
            f"{what} failed on {len(failed)} of {len(errors)} ranks, nothing was changed: " + "; ".join(failed)
        )


def describe(exc: BaseException) -> str:
    """``Type: message`` of an exception (what the agreement reports)."""
    return f"{type(exc).__name__}: {exc}"


# --- save ------------------------------------------------------------------------------------------------------
def _saved_groups(engine: Checkpointable, exclude_frozen: bool) -> dict[str, tuple[int, int]]:
    """This rank's saved range of each group (a whole group is saved by rank 0 only)."""
    out = {}
    for g in engine.groups:
        if (exclude_frozen and g.n_trainable == 0) or (g.master_is_whole and engine.comm.rank != 0):
            continue
        out[g.name] = (0, g.layout.padded_numel) if g.master_is_whole else g.layout.shard_range(engine.comm.rank)
    return out


def _write_rank_file(engine: Checkpointable, partial: Path, exclude_frozen: bool) -> tuple[str, dict[str, Any]]:
    """Write this rank's tensors and RNG; returns the file's checksum and the rank's entry of ``meta.json``."""
    ranges = _saved_groups(engine, exclude_frozen)
    per_element = optim_state.capture_per_element(engine.optimizer, engine.groups, ranges)
    tensors: dict[str, torch.Tensor] = {}
    entry: dict[str, Any] = {}
    for g in engine.groups:
        if g.name not in ranges:
            continue
        tensors[f"{g.name}/master"] = g.master.detach().cpu().clone()
        keys = {"master": "float32"}
        for key, t in per_element.get(g.name, {}).items():
            tensors[f"{g.name}/{key}"] = t
            keys[key] = str(t.dtype).removeprefix("torch.")
        entry[g.name] = {"lo": ranges[g.name][0], "hi": ranges[g.name][1], "keys": keys}
    tensors["rng/torch"] = torch.get_rng_state()
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng/cuda/{i}"] = state
    return write_rank_file(partial, engine.comm.rank, tensors, random.getstate()), entry


def _meta(engine: Checkpointable, tag: str, ranks: list[dict[str, Any]], exclude_frozen: bool) -> dict[str, Any]:
    aliases = param_aliases(engine.module)
    saved = {name for entry in ranks for name in entry}
    params, excluded = {}, []
    for g in engine.groups:
        for slot in g.slots:
            if g.name not in saved or (exclude_frozen and not slot.trainable):
                excluded.append(slot.spec.name)
                continue
            params[slot.spec.name] = {
                "group": g.name,
                "offset": slot.spec.offset,
                "numel": slot.spec.numel,
                "shape": list(slot.spec.shape),
                "aliases": aliases[slot.spec.name],
            }
    hf: Any = getattr(engine.module, "config", None)
    gas = engine.gradient_accumulation_steps
    return {
        "format": FORMAT,
        "tag": tag,
        "world_size": engine.comm.world_size,
        "stage": engine.config.zero.stage,
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps - engine.micro_steps % gas,
        "skipped_steps": engine.skipped_steps,
        "params": params,
        "excluded": excluded,
        "groups": {
            g.name: {"padded_numel": g.layout.padded_numel, "mode": g.mode.value}
            for g in engine.groups
            if g.name in saved
        },
        "ranks": ranks,
        "optimizer": type(engine.optimizer).__name__ if engine.optimizer is not None else None,
        "hf_config": hf.to_dict() if hasattr(hf, "to_dict") else None,
        "model_class": type(engine.module).__name__,
    }


def _write_rank0(
    engine: Checkpointable,
    partial: Path,
    tag: str,
    client_state: Any,
    other: dict[str, Any],
    ranks: list[dict[str, Any]],
    digests: dict[str, str],
    exclude_frozen: bool,
) -> None:
    opt = engine.optimizer
    state = {
        "optimizer": None
        if opt is None
        else {"class": type(opt).__name__, "state": other, "param_groups": optim_state.hyperparameters(opt)},
        "scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "loss_scaler": engine.loss_scaler.state_dict(),
        "client_state": client_state,
    }
    write_shared_files(partial, tag, state, _meta(engine, tag, ranks, exclude_frozen), digests)


def _finish(
    engine: Checkpointable,
    root: Path,
    partial: Path,
    tag: str,
    nonce: str,
    client_state: Any,
    gathered: list[Any],
    save_latest: bool,
    exclude_frozen: bool,
) -> None:
    """Rank 0, after every rank wrote its file: state, meta, manifest, publication, ``latest``."""
    failed = [f"rank {r}: {res}" for r, (res, _) in enumerate(gathered) if isinstance(res, str)]
    if failed:
        raise CheckpointError("; ".join(failed))
    merged: dict[str, dict[str, Any]] = {}
    for _, part in gathered:  # non-element state per optimizer group: the first rank's value of each key
        for k, values in part.items():
            merged[k] = {**values, **merged.get(k, {})}
    digests = {rank_file(r): res[0] for r, (res, _) in enumerate(gathered)}
    _write_rank0(engine, partial, tag, client_state, merged, [res[1] for res, _ in gathered], digests, exclude_frozen)
    publish(root, partial, tag, nonce)
    if save_latest:
        write_latest(root, tag, nonce)


def _agree_arguments(
    comm: Comm, tag: Any, root: Path, client_state: Any, save_latest: bool, exclude_frozen: bool
) -> None:
    """Every rank checks its arguments (tag, JSON client state), then all compare them in one all-gather: a bad
    argument on any rank, or ranks passing different ones, raise the same CheckpointError on every rank before
    anything is written (naming both values)."""
    error, text = None, ""
    try:
        check_tag(tag)
        check_plain_json({} if client_state is None else client_state)
        text = json.dumps({} if client_state is None else client_state, sort_keys=True)
    except (TypeError, ValueError) as exc:
        error = describe(exc)
    mine = {
        "tag": tag,
        "save directory": os.path.abspath(root),
        "client_state": hashlib.sha256(text.encode()).hexdigest(),
        "save_latest": bool(save_latest),
        "exclude_frozen_parameters": bool(exclude_frozen),
    }
    shown = {**mine, "save directory": str(root), "client_state": text[:60] + ("..." if len(text) > 60 else "")}
    gathered = comm.all_gather_object((error, mine, shown), phase=_PHASE)
    first = gathered[0][2]
    raise_failed([e for e, _, _ in gathered], f"save_checkpoint(tag={first['tag']!r}) in {first['save directory']}")
    for r, (_, theirs, their_shown) in enumerate(gathered):
        for key, value in theirs.items():
            if value != gathered[0][1][key]:
                raise CheckpointError(
                    f"save_checkpoint: ranks passed different arguments, nothing was written: rank 0 {key} "
                    f"{gathered[0][2][key]!r} vs rank {r} {key} {their_shown[key]!r} (every rank must pass the same "
                    "tag, save directory, client_state, save_latest and exclude_frozen_parameters)"
                )


def save(
    engine: Checkpointable,
    save_dir: str | os.PathLike[str],
    tag: str | None = None,
    client_state: dict[str, Any] | None = None,
    save_latest: bool = True,
    exclude_frozen_parameters: bool = False,
) -> bool:
    """Write a checkpoint of ``engine`` (collective: every rank calls it with the same arguments); True on success."""
    engine.release_held()
    engine.assert_quiescent()
    tag = f"global_step{engine.global_steps}" if tag is None else tag
    root, comm = Path(save_dir), engine.comm
    _agree_arguments(comm, tag, root, client_state, save_latest, exclude_frozen_parameters)
    error = None
    try:
        if comm.rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            check_replaceable(root, tag)
    except (OSError, TypeError, CheckpointError) as exc:
        error = describe(exc)
    agree(comm, error, f"save_checkpoint(tag={tag!r}) in {root}")
    if engine.micro_steps % engine.gradient_accumulation_steps and comm.rank == 0:
        _LOG.warning(
            "save_checkpoint inside a gradient-accumulation window (micro-step %d of %d): parameters, "
            "optimizer state and counters as of the window's start are saved; the partially accumulated "
            "gradients are not",
            engine.micro_steps % engine.gradient_accumulation_steps,
            engine.gradient_accumulation_steps,
        )
    nonce = comm.all_gather_object(uuid.uuid4().hex if comm.rank == 0 else None, phase=_PHASE)[0]
    partial = root / f"{tag}{PARTIAL}{nonce}"
    result: tuple[str, dict[str, Any]] | str
    try:
        partial.mkdir(parents=True, exist_ok=True)
        result = _write_rank_file(engine, partial, exclude_frozen_parameters)
        other = optim_state.capture_other(engine.optimizer, engine.groups)
    except (OSError, TypeError, ValueError, RuntimeError) as exc:
        result, other = describe(exc), {}
    gathered = comm.all_gather_object((result, other), phase=_PHASE)
    error = None
    if comm.rank == 0:
        try:
            _finish(
                engine, root, partial, tag, nonce, client_state or {}, gathered, save_latest, exclude_frozen_parameters
            )
        except (OSError, TypeError, ValueError, RuntimeError) as exc:
            shutil.rmtree(partial, ignore_errors=True)
            error = describe(exc)
    agree(comm, error, f"save_checkpoint(tag={tag!r}) in {root}")
    return True


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
        staged.optimizer = optim_state.stage_optimizer_state(
            engine.optimizer, engine.groups, engine.comm.rank, tag, state["optimizer"], aliases, missing
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
        optim_state.apply_optimizer_state(engine.optimizer, *staged.optimizer)
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

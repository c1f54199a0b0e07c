"""The engine's checkpoint save (the load is :mod:`hybridzero.runtime.checkpointing`; the seam and the failure
agreement are :mod:`hybridzero.runtime.checkpoint_seam`).

Invariants:
* Save is atomic (see :mod:`hybridzero.checkpoint.paths`): ``latest`` moves only after every rank's files are
  written and checksummed and the tag is published. Inside a gradient-accumulation window the consistent state
  is saved (parameters, optimizer state, counters as of the window's start); the partial gradients are not.
* Bad arguments, or ranks passing different ones, raise the same CheckpointError on every rank before anything is
  written; a failure while writing is agreed on and removes the partial directory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

from hybridzero.checkpoint.ds_model_states import DS_MODEL_STATES, write_ds_model_states
from hybridzero.checkpoint.format import FORMAT, rank_file
from hybridzero.checkpoint.jsontree import check_plain_json
from hybridzero.checkpoint.paths import PARTIAL, CheckpointError, check_replaceable, check_tag, publish, write_latest
from hybridzero.checkpoint.recovery import write_recovery_script
from hybridzero.checkpoint.writer import write_rank_file, write_shared_files
from hybridzero.comm.collectives import Comm
from hybridzero.runtime import optim_state
from hybridzero.runtime.checkpoint_seam import _PHASE, Checkpointable, agree, describe, raise_failed
from hybridzero.zero.partition import param_aliases

_LOG = logging.getLogger("hybridzero")


# --- save ------------------------------------------------------------------------------------------------------
def _saved_groups(engine: Checkpointable, exclude_frozen: bool) -> dict[str, tuple[int, int]]:
    """This rank's saved range of each group (a whole group is saved by rank 0 only)."""
    out = {}
    for g in engine.groups:
        if (exclude_frozen and g.n_trainable == 0) or (g.master_is_whole and engine.comm.rank != 0):
            continue
        out[g.name] = (0, g.layout.padded_numel) if g.master_is_whole else g.layout.shard_range(engine.comm.rank)
    return out


def _torch_optimizer(engine: Checkpointable) -> torch.optim.Optimizer | None:
    """The torch optimizer behind ``engine.optimizer`` (its class names the saved state), or None."""
    return engine.optimizer.optimizer if engine.optimizer is not None else None


def _write_rank_file(engine: Checkpointable, partial: Path, exclude_frozen: bool) -> tuple[str, dict[str, Any]]:
    """Write this rank's tensors and RNG; returns the file's checksum and the rank's entry of ``meta.json``."""
    ranges = _saved_groups(engine, exclude_frozen)
    per_element = optim_state.capture_per_element(_torch_optimizer(engine), engine.groups, ranges)
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
        "optimizer": type(engine.optimizer.optimizer).__name__ if engine.optimizer is not None else None,
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
    opt = _torch_optimizer(engine)
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
    if engine.config.zero.stage < 3:  # DeepSpeed's file of the whole module, for DeepSpeed users' torch.load
        counters = {
            "global_steps": engine.global_steps,
            "global_samples": engine.global_samples,
            "skipped_steps": engine.skipped_steps,
            "dp_world_size": engine.comm.world_size,
        }
        digests[DS_MODEL_STATES] = write_ds_model_states(partial, engine.module, exclude_frozen, counters)
    _write_rank0(engine, partial, tag, client_state, merged, [res[1] for res, _ in gathered], digests, exclude_frozen)
    publish(root, partial, tag, nonce)
    if save_latest:
        write_latest(root, tag, nonce)
    write_recovery_script(root, _LOG)  # DeepSpeed's `python SAVE_DIR/zero_to_fp32.py SAVE_DIR OUT` works here too


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
        other = optim_state.capture_other(_torch_optimizer(engine), engine.groups)
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

"""Convert a DeepSpeed (0.19.x) ZeRO-1/2/3 checkpoint into an engine checkpoint (format 2), file to file: no engine,
no process group, no DeepSpeed (``hybridzero convert-checkpoint --from deepspeed DS_DIR OUT_DIR [--tag TAG]``).

What is carried: every trainable parameter's fp32 master, Adam's per-element state (``exp_avg``, ``exp_avg_sq``,
``max_exp_avg_sq``) and ``step``, the optimizer hyperparameters torch's Adam/AdamW/SGD know, the lr scheduler
position (DeepSpeed's ``last_batch_iteration``), the fp16 loss scale (``cur_scale``, hysteresis, the good-step
count), ``global_steps`` / ``skipped_steps`` (``micro_steps`` = ``global_steps`` x gradient accumulation) and, in
``meta.json``'s ``converted_from``, DeepSpeed's version, tag, stage, world size and ``global_samples``. Not carried:
RNG states (DeepSpeed does not save them: the loading engine keeps its own), frozen parameters, client state,
model/pipeline parallel (``mp_world_size`` must be 1).

Reconstruction (per DeepSpeed param group ``g``, parameters in ``param_shapes[g]`` order):
* ZeRO-1/2: the ranks' flat partitions concatenated are the group's flat buffer; parameter ``i`` starts where
  parameter ``i-1`` ended plus its alignment padding (``param_alignment_paddings``); the buffer's end is padding.
* ZeRO-3: every parameter is split on its own into ``ceil(numel / world)`` elements per rank (the last rank's
  piece padded), each rank's pieces concatenated in ``param_shapes`` order over all groups (and over the
  optimizer's sub-groups); the parameter is its ranks' pieces joined, cut to ``numel``.
The result is written as a one-rank checkpoint (one group per DeepSpeed param group, parameters contiguous), which
the engine loads at any world size and stage (:mod:`hybridzero.checkpoint.format` reshards by parameter name).

Invariants: files are read as :mod:`hybridzero.checkpoint.ds_files` describes (no code run, nothing outside
``DS_DIR``); every size is checked against ``param_shapes`` before anything is written; the tag is built through
the engine's own writer and verified with :func:`~hybridzero.checkpoint.format.open_tag` before it is published
(atomically, as :func:`~hybridzero.checkpoint.convert.convert_v1` does; on failure nothing is left in OUT_DIR).
"""

from __future__ import annotations

import math
import os
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybridzero.checkpoint.convert import _check_destination
from hybridzero.checkpoint.ds_files import (
    DSLossScaler,
    ds_tag_dir,
    load_ds_file,
    model_states_file,
    optim_states_file,
)
from hybridzero.checkpoint.format import FORMAT, META, open_tag, rank_file, validate_meta
from hybridzero.checkpoint.paths import LATEST, PARTIAL, CheckpointError, check_tag, publish, write_latest
from hybridzero.checkpoint.writer import write_rank_file, write_shared_files

__all__ = ["DSCheckpoint", "convert_deepspeed", "read_deepspeed"]

_ELEMENT_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")
# hyperparameters torch's Adam/AdamW/SGD take (FusedAdam / DeepSpeedCPUAdam extras are left to the engine)
_HYPER = ("lr", "betas", "eps", "weight_decay", "amsgrad", "momentum", "dampening", "nesterov", "maximize")


@dataclass
class DSCheckpoint:
    """A DeepSpeed tag read into memory: per DeepSpeed param group, its parameters' shapes (``param_shapes`` order)
    and the full fp32 flat tensors (``master`` and every per-element optimizer state) holding those parameters
    contiguously in that order."""

    tag: str
    stage: int
    world_size: int
    shapes: list[dict[str, list[int]]] = field(default_factory=list)
    flats: list[dict[str, torch.Tensor]] = field(default_factory=list)
    step: torch.Tensor | None = None
    hyper: list[dict[str, Any]] = field(default_factory=list)
    model_states: dict[str, Any] = field(default_factory=dict)
    loss_scaler: dict[str, Any] = field(default_factory=dict)
    version: str = "?"


def _fail(file: Path, check: str) -> CheckpointError:
    return CheckpointError(f"DeepSpeed checkpoint file {file}: {check}")


def _shapes(file: Path, states: Any) -> list[dict[str, list[int]]]:
    """``param_shapes`` of a model-states file: one ordered ``{name: shape}`` per param group."""
    groups = states.get("param_shapes") if isinstance(states, dict) else None
    if isinstance(groups, dict):
        groups = [groups]
    ok = isinstance(groups, list) and all(
        isinstance(g, dict) and all(isinstance(n, str) and isinstance(s, (list, tuple)) for n, s in g.items())
        for g in groups
    )
    if not ok or not groups:
        raise _fail(file, "no 'param_shapes' (a list of {name: shape} per param group)")
    out = []
    for g in groups:
        shapes = {n: [int(d) for d in s] for n, s in g.items()}
        if any(d < 0 for s in shapes.values() for d in s):
            raise _fail(file, "a negative dimension in 'param_shapes'")
        out.append(shapes)
    return out


def _tensor(file: Path, where: str, t: Any) -> torch.Tensor:
    if not (isinstance(t, torch.Tensor) and t.dim() == 1 and t.is_floating_point()):
        raise _fail(file, f"{where} must be a 1-D floating tensor, got {type(t).__name__}")
    return t.float()


def _rank_flats(file: Path, opt: dict[str, Any], stage: int) -> tuple[list[torch.Tensor], list[dict[str, Any]], Any]:
    """One rank's fp32 partitions, per-partition optimizer state, and param groups."""
    if stage == 3:
        flats, base = opt.get("fp32_flat_groups"), opt.get("optimizer_state_dict")
    else:
        flats, base = opt.get("single_partition_of_fp32_groups"), opt.get("base_optimizer_state")
    if not isinstance(flats, list) or not isinstance(base, dict) or not isinstance(base.get("state"), dict):
        raise _fail(file, f"not a ZeRO-{stage} optimizer state (no flat fp32 partitions or base optimizer state)")
    state = base["state"]
    parts = [_tensor(file, f"fp32 partition {i}", t) for i, t in enumerate(flats)]
    per = [state.get(i, {}) for i in range(len(parts))]
    if not all(isinstance(s, dict) for s in per):
        raise _fail(file, "optimizer state per partition must be a dict")
    return parts, per, base.get("param_groups")


def _step_of(per: list[dict[str, Any]], groups: Any) -> torch.Tensor | None:
    """Adam's step count: the per-partition ``step`` (torch optimizers) or the group's (FusedAdam)."""
    steps = [float(s["step"]) for s in per if "step" in s]
    if not steps and isinstance(groups, list):
        steps = [float(g["step"]) for g in groups if isinstance(g, dict) and "step" in g]
    if not steps:
        return None
    if len(set(steps)) != 1:
        raise CheckpointError(f"DeepSpeed optimizer groups have different step counts {sorted(set(steps))}")
    return torch.tensor(steps[0], dtype=torch.float32)


def _zero12(tag_dir: Path, ck: DSCheckpoint, ranks: list[tuple[Path, dict[str, Any]]]) -> None:
    """Full flats of ZeRO-1/2 (see the module docstring)."""
    per_rank = [_rank_flats(f, o, 2) for f, o in ranks]
    pads = ranks[0][1].get("param_alignment_paddings")
    for g, shapes in enumerate(ck.shapes):
        if any(len(parts) <= g for parts, _, _ in per_rank):
            raise _fail(ranks[0][0], f"param group {g} has no fp32 partition")
        keys = ["master", *[k for k in _ELEMENT_KEYS if k in per_rank[0][1][g]]]
        full = {}
        for key in keys:
            pieces = [
                parts[g] if key == "master" else _tensor(f, key, per[g].get(key))
                for (f, _), (parts, per, _) in zip(ranks, per_rank)
            ]
            full[key] = torch.cat(pieces)
        group_pads = pads[g] if isinstance(pads, list) and len(pads) > g and isinstance(pads[g], list) else None
        at, placed = 0, {}
        for i, (name, shape) in enumerate(shapes.items()):
            placed[name] = (at, shape)
            at += math.prod(shape) + (int(group_pads[i]) if group_pads and i < len(group_pads) else 0)
        if at > full["master"].numel():
            raise _fail(
                ranks[0][0],
                f"param group {g}: parameters need {at} elements, the partitions hold {full['master'].numel()}",
            )
        ck.flats.append(_compact(full, placed))


def _compact(full: dict[str, torch.Tensor], placed: Mapping[str, tuple[int, list[int]]]) -> dict[str, torch.Tensor]:
    """The group's tensors with its parameters (``placed``: offset and shape, in order) contiguous from 0."""
    return {
        k: torch.cat([v[o : o + math.prod(s)] for o, s in placed.values()]) if placed else v[:0]
        for k, v in full.items()
    }


def _zero3(ck: DSCheckpoint, ranks: list[tuple[Path, dict[str, Any]]]) -> None:
    """Full flats of ZeRO-3 (see the module docstring)."""
    world = ck.world_size
    per_rank = [_rank_flats(f, o, 3) for f, o in ranks]
    keys = ["master", *[k for k in _ELEMENT_KEYS if all(k in s for s in per_rank[0][1])]]
    flat: dict[str, list[torch.Tensor]] = {}
    for key in keys:
        flat[key] = [
            torch.cat(parts if key == "master" else [_tensor(f, key, s.get(key)) for s in per])
            for (f, _), (parts, per, _) in zip(ranks, per_rank)
        ]
    at = 0
    for shapes in ck.shapes:
        pieces: dict[str, list[torch.Tensor]] = {k: [] for k in keys}
        for name, shape in shapes.items():
            numel = int(math.prod(shape))
            part = (numel + world - 1) // world
            for key in keys:
                if any(at + part > t.numel() for t in flat[key]):
                    raise _fail(ranks[0][0], f"'{name}' needs elements up to {at + part} of every rank's {key}")
                pieces[key].append(torch.cat([t[at : at + part] for t in flat[key]])[:numel])
            at += part
        ck.flats.append({k: torch.cat(v) if v else torch.zeros(0) for k, v in pieces.items()})


def read_deepspeed(ds_dir: str | os.PathLike[str], tag: str | None = None) -> DSCheckpoint:
    """Read and reconstruct DeepSpeed tag ``tag`` (default: ``latest``) of ``ds_dir`` (see the module docstring)."""
    tag_dir = ds_tag_dir(Path(ds_dir), tag)
    stage = 3 if (tag_dir / model_states_file(3, 0)).is_file() else 2
    states = load_ds_file(tag_dir, model_states_file(stage, 0))
    where = tag_dir / model_states_file(stage, 0)
    if not isinstance(states, dict):
        raise _fail(where, "not a dict")
    if states.get("mp_world_size", 1) != 1:
        raise _fail(where, f"mp_world_size {states.get('mp_world_size')}: model/pipeline parallel is not converted")
    world = states.get("dp_world_size")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise _fail(where, f"dp_world_size must be an integer >= 1, got {world!r}")
    bf16 = (tag_dir / optim_states_file(0, True)).is_file()
    ranks = [
        (tag_dir / optim_states_file(r, bf16), load_ds_file(tag_dir, optim_states_file(r, bf16))) for r in range(world)
    ]
    opts = []
    for file, payload in ranks:
        opt = payload.get("optimizer_state_dict") if isinstance(payload, dict) else None
        if not isinstance(opt, dict):
            raise _fail(file, "no 'optimizer_state_dict'")
        opts.append((file, opt))
    stage = int(opts[0][1].get("zero_stage", stage))
    ck = DSCheckpoint(check_tag(tag_dir.name), stage, world, shapes=_shapes(where, states), model_states=states)
    ck.version = str(states.get("ds_version", "?"))
    (_zero3 if stage == 3 else lambda c, r: _zero12(tag_dir, c, r))(ck, opts)
    _, per, groups = _rank_flats(opts[0][0], opts[0][1], stage)
    ck.step = _step_of(per, groups)
    if isinstance(groups, list):
        ck.hyper = [
            {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k in _HYPER}
            for g in groups
            if isinstance(g, dict)
        ]
    scaler = opts[0][1].get("loss_scaler")
    ck.loss_scaler = scaler.state if isinstance(scaler, DSLossScaler) else {}
    return ck


def _optimizer_class(ds_config: Any) -> str | None:
    """The torch class the engine builds for the config's optimizer block (see :mod:`hybridzero.optim.factory`)."""
    opt = ds_config.get("optimizer") if isinstance(ds_config, dict) else None
    if not isinstance(opt, dict) or not isinstance(opt.get("type"), str):
        return None
    kind, params = opt["type"].lower(), opt.get("params") or {}
    if kind in ("adamw", "adam"):
        return "AdamW" if kind == "adamw" or params.get("adam_w_mode", True) else "Adam"
    return {"sgd": "SGD"}.get(kind)


def scaler_state(ds: Mapping[str, Any], ds_config: Any) -> dict[str, Any]:
    """The engine's loss-scaler state (:mod:`hybridzero.optim.loss_scaler`) from DeepSpeed's pickled scaler."""
    fp16 = ds_config.get("fp16") if isinstance(ds_config, dict) else None
    hysteresis = int(fp16.get("hysteresis", 2)) if isinstance(fp16, dict) else 2
    scale = float(ds.get("cur_scale", 1.0))
    if not ds.get("dynamic", "cur_iter" in ds) or "cur_iter" not in ds:
        return {"scale": scale, "hysteresis_left": max(1, hysteresis), "good_steps": 0, "step": 0}
    step = int(ds["cur_iter"])
    good = step - int(ds.get("last_overflow_iter", -1)) - 1
    return {
        "scale": scale,
        "hysteresis_left": max(1, int(ds.get("cur_hysteresis", hysteresis))),
        "good_steps": max(0, min(good, step)),
        "step": step,
    }


def _scheduler_state(states: Mapping[str, Any], lrs: list[float]) -> dict[str, Any] | None:
    """The engine's DeepSpeed-scheduler state from DeepSpeed's ``lr_scheduler`` (``last_batch_iteration``)."""
    sched = states.get("lr_scheduler")
    if not isinstance(sched, dict) or "last_batch_iteration" not in sched:
        return None
    it = int(sched["last_batch_iteration"])
    return {"last_batch_iteration": it, "last_epoch": it + 1, "_step_count": it + 2, "_last_lr": lrs}


def _meta(ck: DSCheckpoint, ranks_entry: dict[str, Any], groups: dict[str, Any], params: dict[str, Any]) -> dict:
    states = ck.model_states
    raw = states.get("ds_config")
    config: dict[str, Any] = raw if isinstance(raw, dict) else {}
    gas = config.get("gradient_accumulation_steps", 1)
    gas = gas if isinstance(gas, int) and not isinstance(gas, bool) and gas > 0 else 1
    steps = states.get("global_steps", 0)
    skipped = states.get("skipped_steps", 0)
    samples = states.get("global_samples")
    return {
        "format": FORMAT,
        "tag": ck.tag,
        "world_size": 1,
        "stage": ck.stage,
        "global_steps": steps,
        "micro_steps": steps * gas if isinstance(steps, int) else steps,
        "skipped_steps": skipped,
        "params": params,
        "excluded": [],
        "groups": groups,
        "ranks": [ranks_entry],
        "optimizer": _optimizer_class(config),
        "hf_config": None,
        "model_class": None,
        "rng": False,
        "converted_from": {
            "format": "deepspeed",
            "version": ck.version,
            "tag": ck.tag,
            "stage": ck.stage,
            "world_size": ck.world_size,
            "global_samples": samples if isinstance(samples, int) else None,
        },
    }


def _write(ck: DSCheckpoint, partial: Path) -> None:
    """Write the converted tag into ``partial`` and verify it as a loader would."""
    tensors: dict[str, torch.Tensor] = {}
    entry: dict[str, Any] = {}
    groups: dict[str, Any] = {}
    params: dict[str, Any] = {}
    for g, (shapes, flats) in enumerate(zip(ck.shapes, ck.flats)):
        name = f"deepspeed{g}"
        n = flats["master"].numel()
        groups[name] = {"padded_numel": n, "mode": "params_whole"}
        entry[name] = {"lo": 0, "hi": n, "keys": {k: "float32" for k in flats}}
        for key, t in flats.items():
            tensors[f"{name}/{key}"] = t.contiguous().clone()
        offset = 0
        for pname, shape in shapes.items():
            params[pname] = {
                "group": name,
                "offset": offset,
                "numel": math.prod(shape),
                "shape": shape,
                "aliases": [pname],
            }
            offset += math.prod(shape)
    meta = _meta(ck, entry, groups, params)
    validate_meta(meta, partial / META)
    config = ck.model_states.get("ds_config")
    lrs = [float(h["lr"]) for h in ck.hyper if isinstance(h.get("lr"), (int, float))]
    other = (
        {}
        if ck.step is None
        else {str(g): {"step": {"value": ck.step.clone(), "on_param_device": False}} for g in range(len(ck.hyper))}
    )
    cls = meta["optimizer"]
    state = {
        "optimizer": None if cls is None else {"class": cls, "state": other, "param_groups": ck.hyper},
        "scheduler": _scheduler_state(ck.model_states, lrs),
        "loss_scaler": scaler_state(ck.loss_scaler, config),
        "client_state": {},
    }
    digest = write_rank_file(partial, 0, tensors, None)
    write_shared_files(partial, ck.tag, state, meta, {rank_file(0): digest})
    open_tag(partial).state()


def convert_deepspeed(ds_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], tag: str | None = None) -> Path:
    """Convert DeepSpeed tag ``tag`` (default: the one ``ds_dir/latest`` names) into an engine checkpoint of the
    same tag under ``out_dir``; returns the new tag directory; ``out_dir/latest`` names it when ``out_dir`` had no
    ``latest`` or the converted tag is DeepSpeed's latest. Raises :class:`CheckpointError` naming the file and the
    check for anything refused; then nothing is left in ``out_dir`` and ``ds_dir`` is never written."""
    src, dst = Path(ds_dir), Path(out_dir)
    ck = read_deepspeed(src, tag)
    _check_destination(src, dst, ck.tag)
    latest_file = src / LATEST
    ds_latest = latest_file.read_text(errors="replace").strip() if latest_file.is_file() else None
    created = not dst.exists()
    nonce = uuid.uuid4().hex
    partial = dst / f"{ck.tag}{PARTIAL}{nonce}"
    try:
        partial.mkdir(parents=True)
        _write(ck, partial)
        final = publish(dst, partial, ck.tag, nonce)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        if created:
            shutil.rmtree(dst, ignore_errors=True)
        raise
    if ds_latest == ck.tag or not (dst / LATEST).exists():
        write_latest(dst, ck.tag, nonce)
    return final

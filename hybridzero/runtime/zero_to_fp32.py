"""DeepSpeed's ``deepspeed.utils.zero_to_fp32`` on hybridzero's own checkpoints.

A DeepSpeed user consolidates a ZeRO checkpoint into one fp32 state dict with these three functions; here they read
a checkpoint written by ``engine.save_checkpoint`` (any stage, any world size) through
:func:`hybridzero.checkpoint.export.consolidated_state_dict`, which verifies it fully first (checksums, metadata)
and reads nothing but safetensors and JSON. Checkpoints written by DeepSpeed itself are converted first
(``hybridzero convert-checkpoint --from deepspeed``).

As in DeepSpeed: every name of a tied parameter is a key (the tensors are the same object); values are the fp32
master weights; ``load_state_dict_from_zero_checkpoint`` moves the model to the CPU and loads non-strictly.
Pure functions of the files, but for the model and the output directory they are asked to write.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn

from hybridzero.checkpoint.export import consolidated_state_dict
from hybridzero.checkpoint.format import open_tag
from hybridzero.checkpoint.paths import find_tag

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
    "main",
]

_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def _aliases(checkpoint_dir: str | os.PathLike[str], tag: str | None) -> dict[str, list[str]]:
    path = find_tag(checkpoint_dir, tag)
    if path is None:
        raise FileNotFoundError(f"no checkpoint {'latest' if tag is None else repr(tag)} in {checkpoint_dir}")
    return {name: list(info["aliases"]) for name, info in open_tag(path).meta["params"].items()}


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
) -> dict[str, torch.Tensor]:
    """Every parameter's full fp32 value, keyed by every name it has (``tag`` defaults to ``latest``).

    ``exclude_frozen_parameters`` is honoured at save time here (``save_checkpoint(...,
    exclude_frozen_parameters=True)`` leaves them out); asking for it at read time is refused, since the checkpoint
    does not say which parameters were frozen. ``lazy_mode`` gives the same dict (values are read eagerly)."""
    del lazy_mode
    if exclude_frozen_parameters:
        raise ValueError(
            "get_fp32_state_dict_from_zero_checkpoint(exclude_frozen_parameters=True): a hybridzero checkpoint "
            "does not record which parameters were frozen; save with save_checkpoint(..., "
            "exclude_frozen_parameters=True) and read with exclude_frozen_parameters=False"
        )
    values = consolidated_state_dict(checkpoint_dir, tag)
    out: dict[str, torch.Tensor] = {}
    for name, names in _aliases(checkpoint_dir, tag).items():
        for alias in names:
            out[alias] = values[name]
    return out


def load_state_dict_from_zero_checkpoint(
    model: nn.Module, checkpoint_dir: str | os.PathLike[str], tag: str | None = None
) -> nn.Module:
    """``model`` moved to the CPU with the checkpoint's fp32 values loaded (non-strict); returns it. Like
    DeepSpeed's, meant for a model outside any engine (an engine's ZeRO-3 parameters are placeholders)."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def _shard_bytes(max_shard_size: int | str) -> int:
    if isinstance(max_shard_size, int):
        return max_shard_size
    text = max_shard_size.strip().upper()
    for unit in sorted(_UNITS, key=len, reverse=True):
        if text.endswith(unit) and text[: -len(unit)].strip().isdigit():
            return int(text[: -len(unit)]) * _UNITS[unit]
    raise ValueError(f"max_shard_size = {max_shard_size!r} is invalid: expected bytes or e.g. '5GB', '500MB'")


def _shards(state: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    """Greedy shards in key order; each tensor once (tied names share a tensor, stored under the first)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size, seen = 0, set()
    for name, t in state.items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    max_shard_size: int | str = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> None:
    """Write the consolidated fp32 state dict under ``output_dir`` as DeepSpeed names the files:
    ``pytorch_model.bin`` / ``model.safetensors``, or ``pytorch_model-0000i-of-0000n.bin`` (``model-...safetensors``)
    shards with a ``*.index.json`` weight map when it exceeds ``max_shard_size``. ``.bin`` files hold plain tensors
    only (loadable with ``torch.load(weights_only=True)``)."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem, ext = ("model", "safetensors") if safe_serialization else ("pytorch_model", "bin")
    shards = _shards(state, _shard_bytes(max_shard_size))
    names = (
        [f"{stem}.{ext}"]
        if len(shards) == 1
        else [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.{ext}" for i in range(len(shards))]
    )
    weight_map: dict[str, Any] = {}
    for file, shard in zip(names, shards):
        tensors = {k: v.contiguous() for k, v in shard.items()}
        if safe_serialization:
            safetensors.torch.save_file(tensors, str(out / file), metadata={"format": "pt"})
        else:
            torch.save(tensors, out / file)
        weight_map.update(dict.fromkeys(shard, file))
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / f"{stem}.{ext}.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> None:
    """The recovery script's command line (DeepSpeed's ``zero_to_fp32.py``'s arguments):
    ``CHECKPOINT_DIR OUTPUT_DIR [-t TAG] [--safe_serialization] [--max_shard_size S] [--exclude_frozen_parameters]``."""
    parser = argparse.ArgumentParser(description="Consolidate a hybridzero ZeRO checkpoint into an fp32 state dict")
    parser.add_argument("checkpoint_dir", help="the save directory (holding 'latest' and the tag directories)")
    parser.add_argument("output_dir", help="where pytorch_model.bin / model.safetensors (or shards) are written")
    parser.add_argument("-t", "--tag", default=None, help="the checkpoint tag (default: the one 'latest' names)")
    parser.add_argument("--safe_serialization", action="store_true", help="write safetensors instead of .bin")
    parser.add_argument("--max_shard_size", default="5GB", help="largest output file (e.g. 5GB, 500MB)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="leave frozen parameters out")
    a = parser.parse_args(argv)
    convert_zero_checkpoint_to_fp32_state_dict(
        a.checkpoint_dir,
        a.output_dir,
        max_shard_size=a.max_shard_size,
        safe_serialization=a.safe_serialization,
        tag=a.tag,
        exclude_frozen_parameters=a.exclude_frozen_parameters,
    )

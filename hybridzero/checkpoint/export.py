"""Turn an engine checkpoint (:mod:`hybridzero.checkpoint.format`) into full tensors or a Hugging Face directory.

* :func:`consolidated_state_dict` is the ``zero_to_fp32`` use case: every parameter's fp32 master value in full,
  keyed by its canonical (first) name; a tied tensor appears once. It holds the whole model by design.
* :func:`export_hf` writes ``config.json`` plus safetensors weights that ``from_pretrained`` loads, **streaming**:
  parameters are read one at a time from the rank files (safetensors slices), converted to the export dtype and
  collected for one shard file only; the file is written and its tensors freed before the next shard is read.
  Peak memory is therefore about one shard (``max_shard_bytes``, or the largest tensor if that is bigger) plus one
  parameter in fp32, never the whole model.

File layout follows what ``save_pretrained`` of transformers 5 writes (``huggingface_hub``'s greedy sharding):

* everything within ``max_shard_bytes`` -> a single ``model.safetensors``;
* otherwise ``model-{i:05d}-of-{n:05d}.safetensors`` (1-based) plus ``model.safetensors.index.json`` holding
  ``{"metadata": {"total_parameters", "total_size"}, "weight_map": {name: file}}`` (sorted keys, indent 2).
  Shards are filled in parameter order; a tensor that would overflow the current shard starts the next one, and
  a tensor larger than the limit gets a shard of its own.
* Tied weights are stored once, under the name the model class does not declare as a tie target
  (``_tied_weights_keys``: GPT-2/OPT/tied Llama keep the embedding, drop ``lm_head.weight``); loading re-ties them.
  If the config unties them (``tie_word_embeddings: false``) every alias is written, so nothing loads randomly.

The output appears atomically: it is built in a hidden temporary directory next to ``out_dir`` and renamed into
place only when complete; a failure removes the temporary directory and leaves ``out_dir`` untouched.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
import transformers
from safetensors.torch import save_file

from hybridzero.checkpoint.format import SavedSource, open_tag
from hybridzero.checkpoint.hf_source import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME
from hybridzero.checkpoint.paths import find_tag, list_tags
from hybridzero.lora import LORA_LEFT, LORA_RIGHT, is_lora_name, merged_weights

__all__ = ["EXPORT_DTYPES", "ShardEntry", "ShardPlan", "consolidated_state_dict", "export_hf", "plan_shards"]

EXPORT_DTYPES: MappingProxyType[str, torch.dtype] = MappingProxyType(
    {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
)
"""Export dtype name -> torch dtype (read-only)."""

_CONFIG_DTYPE: MappingProxyType[str, str] = MappingProxyType({"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"})
CONFIG_NAME = "config.json"


@dataclass(frozen=True)
class ShardEntry:
    """One tensor to write: its name in the file, the checkpoint parameter it comes from, numel and shape."""

    name: str
    source: str
    numel: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ShardPlan:
    """Which tensors go to which file. Invariant: ``files[i]`` holds exactly ``shards[i]``; ``len(files) >= 1``."""

    files: tuple[str, ...]
    shards: tuple[tuple[ShardEntry, ...], ...]
    total_size: int
    total_parameters: int

    @property
    def is_sharded(self) -> bool:
        """More than one file (then an index is written)."""
        return len(self.files) > 1


def _open(ckpt_dir: str | os.PathLike[str], tag: str | None) -> tuple[dict[str, Any], SavedSource]:
    """The tag's metadata and a reader of its fp32 master weights, after the full verification of
    :func:`~hybridzero.checkpoint.format.open_tag` (checksums, metadata consistency, rank-file headers)."""
    path = find_tag(ckpt_dir, tag)
    if path is None:
        raise FileNotFoundError(
            f"checkpoint {'latest' if tag is None else repr(tag)} not found in {ckpt_dir}; "
            f"complete tags: {list_tags(ckpt_dir)}"
        )
    saved = open_tag(path)
    return saved.meta, SavedSource(saved, "master")


def _read(
    source: SavedSource,
    entry: ShardEntry,
    dtype: torch.dtype,
    adapters: Mapping[str, tuple[ShardEntry, ShardEntry]] | None = None,
) -> torch.Tensor:
    """The full tensor of ``entry`` in ``dtype`` (contiguous; the fp32 read buffer is dropped after conversion);
    a LoRA base weight named in ``adapters`` comes back merged (:func:`hybridzero.lora.merged_weights`)."""
    value = source.read_flat(entry.source, 0, entry.numel).view(entry.shape)
    if adapters and entry.source in adapters:
        right, left = (source.read_flat(e.source, 0, e.numel).view(e.shape) for e in adapters[entry.source])
        value = merged_weights({"w.weight": value, f"w.{LORA_RIGHT}": right, f"w.{LORA_LEFT}": left})["w.weight"]
    return value.to(dtype)


def lora_adapters(meta: dict[str, Any]) -> dict[str, tuple[ShardEntry, ShardEntry]]:
    """Base-weight name -> (right, left) adapter entries of a checkpoint with DS-Chat LoRA layers (else empty)."""
    params = meta["params"]

    def entry(name: str) -> ShardEntry:
        info = params[name]
        return ShardEntry(name, name, int(info["numel"]), tuple(int(d) for d in info["shape"]))

    return {
        f"{name[: -len(LORA_RIGHT)]}weight": (entry(name), entry(f"{name[: -len(LORA_RIGHT)]}{LORA_LEFT}"))
        for name in params
        if name.endswith("." + LORA_RIGHT)
    }


def consolidated_state_dict(ckpt_dir: str | os.PathLike[str], tag: str | None = None) -> dict[str, torch.Tensor]:
    """Every parameter's full fp32 master value by canonical name (tied weights once, under their first name).

    The checkpoint is verified first (checksums, metadata): a damaged one raises CheckpointError naming the file.

    ``tag`` defaults to the one ``latest`` names. The values equal the engine's ``full_parameters()`` bitwise.
    """
    meta, source = _open(ckpt_dir, tag)
    return {
        name: source.read_flat(name, 0, int(info["numel"])).view(tuple(info["shape"]))
        for name, info in meta["params"].items()
    }


def _dtype(dtype: str) -> torch.dtype:
    """The torch dtype of an export dtype name; ValueError naming the value and the valid ones."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"unsupported export dtype {dtype!r}; valid: {', '.join(EXPORT_DTYPES)}")
    return EXPORT_DTYPES[dtype]


def _skeleton(meta: dict[str, Any]) -> torch.nn.Module | None:
    """The saved model class built on the meta device from the saved config (no memory), or None if impossible."""
    config = meta.get("hf_config") or {}
    cls = getattr(transformers, str(meta.get("model_class")), None)
    mapping = transformers.CONFIG_MAPPING
    if not isinstance(cls, type) or config.get("model_type") not in mapping:
        return None
    try:
        with torch.device("meta"):
            return cls(mapping[config["model_type"]].from_dict(config))
    except (TypeError, ValueError, KeyError, AttributeError, RuntimeError):  # a custom class: fall back below
        return None


def _tie_targets(meta: dict[str, Any], skeleton: torch.nn.Module | None) -> list[str]:
    """Name patterns the model re-ties on load (empty when the config unties them or the model is unknown)."""
    if (meta.get("hf_config") or {}).get("tie_word_embeddings") is False:
        return []
    keys = getattr(skeleton, "_tied_weights_keys", None)  # transformers 5: {target: source}; older: [target, ...]
    return [str(k) for k in keys] if isinstance(keys, (dict, list, tuple)) else []


def _entries(meta: dict[str, Any]) -> list[ShardEntry]:
    """The tensors to write: per parameter its aliases that are not tie targets (at least one name), in the
    model's own parameter order (what ``save_pretrained`` shards by), else in checkpoint order.

    Without a buildable model class every alias is written: loading then needs no re-tying to be complete.
    """
    skeleton = _skeleton(meta)
    targets = _tie_targets(meta, skeleton)
    out: list[ShardEntry] = []
    for canonical, info in meta["params"].items():
        aliases = list(info["aliases"]) or [canonical]
        kept = [a for a in aliases if not any(re.search(p, a) for p in targets)] if len(aliases) > 1 else aliases
        for name in kept or [aliases[0]]:
            out.append(ShardEntry(name, canonical, int(info["numel"]), tuple(int(d) for d in info["shape"])))
    order = (
        {}
        if skeleton is None
        else {name: i for i, (name, _) in enumerate(skeleton.named_parameters(remove_duplicate=False))}
    )
    return sorted(out, key=lambda e: order.get(e.name, len(order)))  # stable: unknown names keep their order


def plan_shards(entries: list[ShardEntry], itemsize: int, max_shard_bytes: int) -> ShardPlan:
    """Split ``entries`` (in order) into files of at most ``max_shard_bytes`` the way ``huggingface_hub`` does."""
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shards: list[list[ShardEntry]] = []
    current: list[ShardEntry] = []
    size = 0
    for e in entries:
        nbytes = e.numel * itemsize
        if nbytes > max_shard_bytes:
            shards.append([e])
            continue
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(e)
        size += nbytes
    if current or not shards:
        shards.append(current)
    n = len(shards)
    files = (
        (SAFE_WEIGHTS_NAME,)
        if n == 1
        else tuple(SAFE_WEIGHTS_NAME.replace(".safetensors", f"-{i + 1:05d}-of-{n:05d}.safetensors") for i in range(n))
    )
    unique = {e.source: e.numel for e in entries}  # an untied alias written twice is one parameter
    return ShardPlan(
        files, tuple(tuple(s) for s in shards), sum(e.numel for e in entries) * itemsize, sum(unique.values())
    )


def _hf_config(meta: dict[str, Any], dtype: str) -> dict[str, Any]:
    """``config.json`` content: the saved HF config with the export dtype and the model's class."""
    config = meta.get("hf_config")
    if not config:
        raise ValueError(
            f"checkpoint of model class {meta.get('model_class')!r} has no Hugging Face config "
            "(hf_config is null in meta.json): only models with a transformers config can be exported "
            "to a Hugging Face directory; use consolidated_state_dict instead"
        )
    out = dict(config)
    out["dtype"] = out["torch_dtype"] = _CONFIG_DTYPE[dtype]
    if meta.get("model_class"):
        out["architectures"] = [meta["model_class"]]
    return out


def _check_out_dir(out: Path) -> None:
    """``out`` must not exist, or be an empty directory."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(
            f"export destination {out} exists and is not an empty directory; choose a new path or remove it"
        )


def _write_weights(
    tmp: Path,
    source: SavedSource,
    plan: ShardPlan,
    dtype: torch.dtype,
    adapters: Mapping[str, tuple[ShardEntry, ShardEntry]] | None = None,
) -> None:
    """Write each planned file, holding only that file's tensors at a time."""
    for file, shard in zip(plan.files, plan.shards):
        tensors: dict[str, torch.Tensor] = {}
        for entry in shard:
            tensors[entry.name] = _read(source, entry, dtype, adapters)
        save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        del tensors
    if plan.is_sharded:
        index = {
            "metadata": {"total_parameters": plan.total_parameters, "total_size": plan.total_size},
            "weight_map": {e.name: f for f, shard in zip(plan.files, plan.shards) for e in shard},
        }
        (tmp / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def export_hf(
    ckpt_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    tag: str | None = None,
    *,
    dtype: str = "fp32",
    max_shard_bytes: int = 5 * 2**30,
    lora: str = "merge",
) -> Path:
    """Write a ``from_pretrained``-loadable directory of checkpoint ``tag`` (default: latest) to ``out_dir``.

    Streams one shard file at a time (see the module docstring); every check (dtype, tag, HF config, destination)
    runs before anything is written. LoRA adapters (DS-Chat's ``lora_right_weight`` / ``lora_left_weight``) are
    never written as such: ``lora="merge"`` folds them into their base weights, ``lora="base"`` writes the base
    weights alone (the base a peft adapter directory, :func:`hybridzero.checkpoint.lora_export.export_adapters`,
    loads onto). Returns ``out_dir``.
    """
    torch_dtype = _dtype(dtype)
    if lora not in ("merge", "base"):
        raise ValueError(
            f"lora = {lora!r} is invalid: expected 'merge' (adapters folded into the weights) or "
            "'base' (base weights only)"
        )
    out = Path(out_dir)
    _check_out_dir(out)
    meta, source = _open(ckpt_dir, tag)
    if meta.get("excluded"):
        raise ValueError(
            f"checkpoint saved with exclude_frozen_parameters: {len(meta['excluded'])} parameters "
            f"(e.g. {meta['excluded'][0]!r}) are not in it, so it cannot become a complete model; "
            "save without exclude_frozen_parameters to export"
        )
    config = _hf_config(meta, dtype)
    adapters = lora_adapters(meta) if lora == "merge" else {}
    entries = [e for e in _entries(meta) if not is_lora_name(e.source)]
    plan = plan_shards(entries, torch.empty((), dtype=torch_dtype).element_size(), max_shard_bytes)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.export-{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        _write_weights(tmp, source, plan, torch_dtype, adapters)
        _check_out_dir(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out

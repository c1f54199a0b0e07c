"""The on-disk format of engine checkpoints, and a lazy reader that serves it as a :class:`TensorSource`.

Layout of ``DIR/TAG/`` (a tag becomes visible only when complete, see :mod:`hybridzero.checkpoint.engine_io`)::

    meta.json         world size, stage, steps, every parameter's (group, offset, numel, shape, aliases), every
                      group's padded size, the optimizer class name, the HF config
    extra.pt          optimizer hyperparameters and per-group scalar state, scheduler and loss scaler state,
                      client state (rank 0)
    rank_00000.pt     per rank: for each group its flat range [lo, hi) and the tensors over it
                      ("master", and each per-element optimizer state such as "exp_avg"), plus RNG states

Because every per-element state is stored in the coordinates of the group's flat buffer, any state can be read
back per parameter and element range (:class:`SavedSource`), whatever the world size, stage or grouping that
reads it: resharding needs no conversion step.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

META = "meta.json"
EXTRA = "extra.pt"
LATEST = "latest"
PARTIAL = ".partial-"


def rank_file(rank: int) -> str:
    """File name of one rank's shard."""
    return f"rank_{rank:05d}.pt"


def list_tags(root: str | os.PathLike[str]) -> list[str]:
    """Complete tags under ``root`` (a directory with ``meta.json``; partial writes are ignored)."""
    base = Path(root)
    if not base.is_dir():
        return []
    return sorted(p.name for p in base.iterdir() if p.is_dir() and PARTIAL not in p.name and (p / META).is_file())


def resolve_tag(root: str | os.PathLike[str], tag: str | None) -> Path:
    """The directory of ``tag`` (default: the one ``latest`` names); a clear error if there is none."""
    base = Path(root)
    if tag is None:
        latest = base / LATEST
        if not latest.is_file():
            raise FileNotFoundError(f"no '{LATEST}' file in checkpoint directory {base}; tags found: {list_tags(base)}")
        tag = latest.read_text().strip()
    path = base / tag
    if not (path / META).is_file():
        raise FileNotFoundError(f"checkpoint tag '{tag}' not found (or incomplete) in {base}; "
                                f"complete tags: {list_tags(base)}")
    return path


def read_meta(path: Path) -> dict[str, Any]:
    """``meta.json`` of a tag directory."""
    try:
        return json.loads((path / META).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"checkpoint metadata {path / META} is unreadable: {exc}") from exc


def load_rank_file(path: Path, rank: int) -> dict[str, Any]:
    """One rank's shard file, memory-mapped; errors name the file."""
    file = path / rank_file(rank)
    if not file.is_file():
        raise FileNotFoundError(f"checkpoint shard {file} is missing")
    try:
        return torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling/zip error means the file is damaged
        raise ValueError(f"checkpoint shard {file} is truncated or corrupt: {exc}") from exc


class SavedSource:
    """Per-element state ``key`` of a saved checkpoint, readable by parameter name and element range."""

    def __init__(self, path: Path, meta: dict[str, Any], shards: list[dict[str, Any]], key: str) -> None:
        self.path, self.meta, self.shards, self.key = path, meta, shards, key
        self._params: dict[str, dict[str, Any]] = meta["params"]

    def names(self) -> list[str]:
        """Saved parameter names (every alias)."""
        return [alias for info in self._params.values() for alias in info["aliases"]]

    def _info(self, name: str) -> dict[str, Any]:
        for canonical, info in self._params.items():
            if name == canonical or name in info["aliases"]:
                return info
        raise KeyError(f"parameter '{name}' is not in checkpoint {self.path}")

    def shape(self, name: str) -> torch.Size:
        """Saved shape of ``name``."""
        return torch.Size(self._info(name)["shape"])

    def dtype(self, name: str) -> torch.dtype:
        """State is stored in fp32."""
        return torch.float32

    def read_flat(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of ``name``'s flattened state, assembled from every rank file that holds some."""
        info = self._info(name)
        if not 0 <= lo <= hi <= info["numel"]:
            raise ValueError(f"range [{lo}, {hi}) outside parameter '{name}' of {info['numel']} elements")
        out = torch.zeros(hi - lo, dtype=torch.float32)
        start, stop = info["offset"] + lo, info["offset"] + hi
        for shard in self.shards:
            part = shard["groups"].get(info["group"])
            if part is None or self.key not in part["tensors"]:
                continue
            a, b = max(start, part["lo"]), min(stop, part["hi"])
            if a < b:
                out[a - start:b - start].copy_(part["tensors"][self.key][a - part["lo"]:b - part["lo"]])
        return out

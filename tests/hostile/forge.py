"""What a forger does to a saved tag: edit a file, then re-sign it in the manifest (SHA-256 recomputed), so that
only the loader's checks of types, shapes and ranges stand between the edit and the engine."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

TAG = "global_step1"


def resign(tag_dir: Path) -> None:
    """Recompute every listed file's SHA-256 in ``manifest.json`` (the README's "forger")."""
    file = tag_dir / "manifest.json"
    manifest = json.loads(file.read_text())
    for name in manifest["files"]:
        target = tag_dir / name
        if target.is_file():
            manifest["files"][name] = hashlib.sha256(target.read_bytes()).hexdigest()
    file.write_text(json.dumps(manifest))


def digest(root: Path) -> str:
    """Hash of every path, file content and link target under ``root``."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_symlink():
            h.update(b"->" + str(p.readlink()).encode())
        elif p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def copy_tree(src: Path, dst: Path) -> Path:
    """A private copy of a checkpoint directory."""
    shutil.copytree(src, dst, symlinks=True)
    return dst


Forge = Callable[[Path], None]


def json_edit(name: str, edit: Callable[[Any], Any]) -> Forge:
    """Edit ``TAG/name`` (JSON) through ``edit(obj) -> obj`` and re-sign."""

    def forge(root: Path) -> None:
        file = root / TAG / name
        file.write_text(json.dumps(edit(json.loads(file.read_text()))))
        resign(root / TAG)

    return forge


def state_edit(edit: Callable[[dict[str, Any]], None]) -> Forge:
    """Edit ``state.json`` in place through ``edit(state)`` and re-sign."""

    def apply(state: dict[str, Any]) -> dict[str, Any]:
        edit(state)
        return state

    return json_edit("state.json", apply)


def rank_edit(rank: int, edit: Callable[[dict[str, torch.Tensor], dict[str, Any]], None]) -> Forge:
    """Edit a rank file's tensors and header JSON through ``edit(tensors, header)`` and re-sign."""

    def forge(root: Path) -> None:
        file = root / TAG / f"rank_{rank:05d}.safetensors"
        with safe_open(str(file), framework="pt") as f:
            tensors = {k: f.get_tensor(k).clone() for k in f.keys()}
            meta = dict(f.metadata() or {})
        header = json.loads(meta["hybridzero"])
        edit(tensors, header)
        meta["hybridzero"] = json.dumps(header)
        save_file(tensors, str(file), metadata=meta)
        resign(root / TAG)

    return forge


def raw_rank_bytes(rank: int, make: Callable[[bytes], bytes]) -> Forge:
    """Replace a rank file's bytes with ``make(old_bytes)`` and re-sign."""

    def forge(root: Path) -> None:
        file = root / TAG / f"rank_{rank:05d}.safetensors"
        file.write_bytes(make(file.read_bytes()))
        resign(root / TAG)

    return forge


def safetensors_bytes(header: dict[str, Any], data: bytes) -> bytes:
    """A safetensors file with a hand-written header (8-byte little-endian length, JSON, data)."""
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


def duplicate_key_header(old: bytes) -> bytes:
    """``old`` with its first tensor listed twice in the JSON header (the second entry pointing elsewhere)."""
    n = int.from_bytes(old[:8], "little")
    text = old[8 : 8 + n].decode()
    header = json.loads(text)
    name = next(k for k in header if k != "__metadata__")
    entry = json.dumps(header[name])
    doubled = text.replace("{", "{" + json.dumps(name) + ": " + entry + ", ", 1).encode()
    return len(doubled).to_bytes(8, "little") + doubled + old[8 + n :]

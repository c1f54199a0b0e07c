"""Writing the files of one format-2 tag (:mod:`hybridzero.checkpoint.format`) into a directory being built.

The engine's save (:mod:`hybridzero.runtime.checkpointing`) and the format-1 converter
(:mod:`hybridzero.checkpoint.convert`) both write through these functions, so a converted tag is byte-for-byte the
layout a save produces. Publication (rename into place, ``latest``) is :mod:`hybridzero.checkpoint.paths`.

Invariants:
* Every file is written into a ``TAG.partial-<nonce>`` directory that nothing reads until it is published.
* ``manifest.json`` is written last, after the SHA-256 of every other file is known: a directory holding it is
  complete (see :func:`hybridzero.checkpoint.paths.is_ours`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from hybridzero.checkpoint.format import (
    META,
    RANK_HEADER_KEY,
    STATE_JSON,
    STATE_TENSORS,
    manifest_text,
    rank_file,
    sha256_file,
)
from hybridzero.checkpoint.jsontree import dumps, encode
from hybridzero.checkpoint.paths import MANIFEST

__all__ = ["write_rank_file", "write_shared_files"]


def write_rank_file(partial: Path, rank: int, tensors: dict[str, torch.Tensor], python_rng: Any) -> str:
    """Write ``rank``'s safetensors file (``GROUP/KEY`` ranges and ``rng/...`` tensors; the python RNG state as JSON
    in the header) into ``partial``; returns its SHA-256. ``tensors`` must be contiguous and share no storage."""
    header = dumps(encode({"rank": rank, "python_rng": python_rng}, {}, "rng"))
    file = partial / rank_file(rank)
    save_file(tensors, str(file), metadata={RANK_HEADER_KEY: header})
    return sha256_file(file)


def write_shared_files(
    partial: Path, tag: str, state: dict[str, Any], meta: dict[str, Any], digests: dict[str, str]
) -> None:
    """Write ``state.json`` + ``state.safetensors`` (``state``: optimizer, scheduler, loss_scaler, client_state),
    ``meta.json`` and, last, ``manifest.json`` listing ``digests`` (the rank files') plus those three.

    TypeError naming the path of a value in ``state`` that cannot be stored (see :func:`jsontree.encode`)."""
    tensors: dict[str, torch.Tensor] = {}
    text = dumps(encode(state, tensors, ""))
    (partial / STATE_JSON).write_text(text)
    save_file(tensors, str(partial / STATE_TENSORS))
    (partial / META).write_text(dumps(meta))
    files = dict(digests)
    for name in (STATE_JSON, STATE_TENSORS, META):
        files[name] = sha256_file(partial / name)
    (partial / MANIFEST).write_text(manifest_text(files, tag))

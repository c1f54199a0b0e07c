"""Readers behind :func:`hybridzero.rlhf.data.load_records`: JSON, JSONL, saved ``datasets`` directories and Hub
dataset names (the last two through the optional ``datasets`` package). Each returns the raw rows; validation and
schema checks happen in :mod:`hybridzero.rlhf.data`."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

__all__ = [
    "read_hf_directory",
    "read_hf_split",
    "read_hub_dataset",
    "read_json_file",
    "read_jsonl_file",
    "read_jsonl_lines",
]


def _text(path: Path) -> str:
    """The file as UTF-8 text (a leading byte-order mark dropped); a ``ValueError`` naming the file, the line and
    the byte offset of the first byte that is not UTF-8."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ValueError(
            f"{path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
            f"data files must be UTF-8"
        ) from None


def read_json_file(path: Path) -> list[Any]:
    """Parse a ``.json`` file that must hold a list of objects."""
    try:
        data = json.loads(_text(path))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{exc.lineno}: invalid JSON ({exc})") from None
    except RecursionError:
        raise ValueError(f"{path}: invalid JSON (nested too deeply)") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of objects, got {type(data).__name__}")  # noqa: TRY004
    return data


def read_jsonl_lines(path: Path) -> list[tuple[int, Any]]:
    """Parse a ``.jsonl`` file, one JSON value per non-blank line: ``(line number, value)`` pairs."""
    rows: list[tuple[int, Any]] = []
    for lineno, line in enumerate(_text(path).split("\n"), start=1):
        if not line.strip():
            continue
        try:
            rows.append((lineno, json.loads(line)))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: invalid JSON line ({exc})") from None
        except RecursionError:
            raise ValueError(f"{path}:{lineno}: invalid JSON line (nested too deeply)") from None
    return rows


def read_jsonl_file(path: Path) -> list[Any]:
    """Parse a ``.jsonl`` file, one JSON value per non-blank line."""
    return [row for _, row in read_jsonl_lines(path)]


def read_hf_directory(path: Path, split: str) -> list[Any]:
    """Read one split of a ``datasets`` directory saved with ``save_to_disk``."""
    try:
        datasets = importlib.import_module("datasets")
    except ImportError as exc:
        raise ImportError(
            f"{path} is a directory: reading a Hugging Face dataset directory needs the optional "
            f"'datasets' package (pip install datasets), which is not installed"
        ) from exc
    loaded = datasets.load_from_disk(str(path))
    if hasattr(loaded, "keys"):  # a DatasetDict
        if split not in loaded:
            raise ValueError(f"{path}: no split {split!r}; available splits: {sorted(loaded.keys())}")
        loaded = loaded[split]
    return [dict(row) for row in loaded]


def read_hf_split(path: Path, split: str) -> list[Any] | None:
    """One split of a ``save_to_disk`` directory, or ``None`` when it has no such split (a directory of a single
    ``Dataset`` holds the ``train`` split only)."""
    datasets = importlib.import_module("datasets")  # the caller already read the train split through it
    loaded = datasets.load_from_disk(str(path))
    if not hasattr(loaded, "keys"):
        return None if split != "train" else [dict(row) for row in loaded]
    return [dict(row) for row in loaded[split]] if split in loaded else None


def read_hub_dataset(name: str, split: str) -> list[Any]:
    """``datasets.load_dataset(name, split=split)`` (a Hub name such as ``Dahoas/rm-static``; needs the optional
    ``datasets`` package and network access, or its local cache)."""
    try:
        datasets = importlib.import_module("datasets")
    except ImportError as exc:
        raise FileNotFoundError(
            f"no dataset at {name!r}: not a local file or directory, and loading it by name from the Hugging Face "
            f"Hub needs the optional 'datasets' package (pip install datasets), which is not installed"
        ) from exc
    try:
        loaded = datasets.load_dataset(name, split=split)
    except Exception as exc:
        raise FileNotFoundError(
            f"no dataset at {name!r}: not a local file or directory, and the Hub load "
            f"failed ({type(exc).__name__}: {exc})"
        ) from exc
    return [dict(row) for row in loaded]

"""Lazy, slice-wise tensor sources for loading checkpoints straight into ZeRO-3 shards.

A ZeRO-3 rank owns a contiguous range of its group's flat buffer, so for each parameter it
needs only the elements ``[lo, hi)`` of that parameter's row-major flattened tensor. A
:class:`TensorSource` answers exactly that question, without materializing whole tensors:

* :class:`HFCheckpointSource` reads a Hugging Face safetensors checkpoint (single file or an
  index with several shard files) and touches only the dim-0 rows that cover ``[lo, hi)``.
* :class:`ModuleSource` serves the same interface from an already materialized ``nn.Module``
  (useful for tests and for ranks that can afford the full model).

Tied weights are stored under a single name (GPT-2 and OPT save the embedding, not
``lm_head.weight``), so callers pick a stored name with :func:`resolve_name`.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from hybridzero.tensor_source import FLOAT_EXPECTED, TensorSource, check_range, dtype_label, resolve_name

__all__ = [
    "CheckpointFileError",
    "HFCheckpointSource",
    "ModuleSource",
    "TensorSource",
    "check_against_model",
    "check_range",
    "resolve_name",
]

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"

# Read-only map from safetensors dtype tags to torch dtypes (immutable by construction).
_ST_DTYPES: MappingProxyType[str, torch.dtype] = MappingProxyType(
    {
        "BOOL": torch.bool,
        "U8": torch.uint8,
        "I8": torch.int8,
        "I16": torch.int16,
        "U16": torch.uint16,
        "I32": torch.int32,
        "U32": torch.uint32,
        "I64": torch.int64,
        "U64": torch.uint64,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "F32": torch.float32,
        "F64": torch.float64,
        "F8_E4M3": torch.float8_e4m3fn,
        "F8_E5M2": torch.float8_e5m2,
    }
)


class CheckpointFileError(OSError):
    """A checkpoint file exists but cannot be parsed (truncated, corrupt, or malformed index)."""


def confined_name(index: Path, value: object) -> str:
    """``value`` (a file name from ``index``) if it names a file inside the index's directory, else ValueError.

    Checked lexically (no symlink resolution: a Hugging Face cache snapshot links its files into a blob store), so
    absolute paths, drive letters, ``..`` components, empty names and control characters are refused."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"file name {value!r} in {index} must be a non-empty string")
    parts = value.replace("\\", "/").split("/")
    if (
        os.path.isabs(value)
        or value.startswith(("/", "\\"))
        or ":" in value
        or any(p in ("", ".", "..") for p in parts)
        or any(ord(c) < 32 or ord(c) == 127 for c in value)
    ):
        raise ValueError(
            f"file name {value!r} in {index} leaves the checkpoint directory {index.parent} "
            "(only relative names inside it are allowed)"
        )
    return value


def _resolve_files(path: Path) -> tuple[Path, dict[str, Path] | None]:
    """Return ``(description_path, weight_map)``; ``weight_map`` is None for a single file.

    A directory prefers ``model.safetensors`` over an index (as transformers does). Every shard
    file the index names must exist; otherwise FileNotFoundError names the missing file.
    """
    if path.is_file():
        return path, None
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint path does not exist: {path}")
    single = path / SAFE_WEIGHTS_NAME
    if single.is_file():
        return single, None
    index = path / SAFE_WEIGHTS_INDEX_NAME
    if not index.is_file():
        raise FileNotFoundError(f"no {SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME} in checkpoint directory {path}")
    try:
        raw: Any = json.loads(index.read_text())
        mapping = raw["weight_map"]
        weight_map = {str(k): path / confined_name(index, v) for k, v in mapping.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointFileError(f"malformed safetensors index {index}: {exc}") from exc
    for shard in sorted(set(weight_map.values())):
        if not shard.is_file():
            raise FileNotFoundError(f"shard file {shard} listed in {index} does not exist")
    return index, weight_map


def _torch_dtype(name: str, file: Path, sl: Any) -> torch.dtype:
    """The torch dtype of a safetensors slice; CheckpointFileError for unsupported tags."""
    tag = sl.get_dtype()
    if tag not in _ST_DTYPES:
        raise CheckpointFileError(f"unsupported dtype {tag} for {name!r} in {file}")
    return _ST_DTYPES[tag]


class HFCheckpointSource(TensorSource):
    """Lazily reads a HF safetensors checkpoint: a directory with model.safetensors, or with
    model.safetensors.index.json and its shard files, or a single .safetensors file path.

    Invariants: each shard file is opened at most once (lazily, on first use) and kept open
    until :meth:`close`; ``read_flat`` only touches the dim-0 rows covering ``[lo, hi)`` and
    adds exactly those rows' byte size to :meth:`bytes_read`; results are fresh tensors.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._described, weight_map = _resolve_files(self.path)
        self._weight_map: dict[str, Path] | None = weight_map
        self._handles: dict[Path, Any] = {}
        self._single_keys: frozenset[str] | None = None
        self._bytes_read = 0
        self._closed = False

    def __repr__(self) -> str:
        return f"HFCheckpointSource({str(self.path)!r})"

    def __enter__(self) -> HFCheckpointSource:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Release every open shard handle; further reads raise RuntimeError. Idempotent."""
        handles, self._handles = self._handles, {}
        for handle in handles.values():
            handle.__exit__(None, None, None)
        self._closed = True

    def bytes_read(self) -> int:
        """Total bytes of stored rows materialized by :meth:`read_flat` so far."""
        return self._bytes_read

    def _handle(self, file: Path) -> Any:
        """The open safetensors handle for ``file``, opening it once on first use."""
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        handle = self._handles.get(file)
        if handle is None:
            if not file.is_file():
                raise FileNotFoundError(f"safetensors file {file} does not exist")
            try:
                handle = safe_open(str(file), framework="pt")
            except SafetensorError as exc:
                raise CheckpointFileError(f"cannot read safetensors file {file}: {exc}") from exc
            self._handles[file] = handle
        return handle

    def _file_of(self, name: str) -> Path:
        """The file holding ``name``; KeyError naming it and the checkpoint if absent."""
        if self._weight_map is None:
            if self._single_keys is None:
                self._single_keys = frozenset(self._handle(self._described).keys())
            if name in self._single_keys:
                return self._described
        elif name in self._weight_map:
            return self._weight_map[name]
        raise KeyError(f"tensor {name!r} not found in checkpoint {self.path}")

    def _slice(self, name: str) -> tuple[Path, Any]:
        file = self._file_of(name)
        try:
            return file, self._handle(file).get_slice(name)
        except SafetensorError as exc:
            raise CheckpointFileError(f"cannot read {name!r} from {file}: {exc}") from exc

    def names(self) -> list[str]:
        """All stored tensor names, sorted."""
        if self._weight_map is None:
            return sorted(self._handle(self._described).keys())
        return sorted(self._weight_map)

    def shape(self, name: str) -> torch.Size:
        """Stored shape of ``name`` (read from the header only)."""
        return torch.Size(self._slice(name)[1].get_shape())

    def dtype(self, name: str) -> torch.dtype:
        """Stored dtype of ``name`` (read from the header only)."""
        return _torch_dtype(name, *self._slice(name))

    def read_flat(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the row-major flattened ``name``, as a fresh 1-D tensor.

        Reads dim-0 rows ``[lo // row, ceil(hi / row))`` where ``row`` is the element count of
        one dim-0 row (1 for 0-d and 1-d tensors), then copies out the flat sub-range.
        """
        file, sl = self._slice(name)
        shape = torch.Size(sl.get_shape())
        dtype = _torch_dtype(name, file, sl)
        check_range(name, shape.numel(), lo, hi)
        if lo == hi:
            return torch.empty(0, dtype=dtype)
        try:
            if len(shape) == 0:
                rows, first = sl[...].reshape(-1), 0
            else:
                row = math.prod(shape[1:])
                first, last = lo // row, -(-hi // row)
                rows = sl[first:last].reshape(-1)
                first *= row
        except SafetensorError as exc:
            raise CheckpointFileError(f"cannot read {name!r} from {file}: {exc}") from exc
        self._bytes_read += rows.numel() * rows.element_size()
        # get_slice returns views into the mmap: copy only the requested part out.
        return rows[lo - first : hi - first].clone()


class ModuleSource(TensorSource):
    """Values of an already materialized nn.Module's parameters (by the names of
    module.named_parameters(remove_duplicate=False)), so tied parameters answer to every name.

    Invariant: reads reflect the parameters' current values; results never alias them.
    """

    def __init__(self, module: nn.Module) -> None:
        self._params: dict[str, nn.Parameter] = dict(module.named_parameters(remove_duplicate=False))
        self._label = type(module).__name__

    def __repr__(self) -> str:
        return f"ModuleSource({self._label})"

    def _param(self, name: str) -> nn.Parameter:
        if name not in self._params:
            raise KeyError(f"parameter {name!r} not found in {self!r}")
        return self._params[name]

    def names(self) -> list[str]:
        """All parameter names in registration order (tied names included)."""
        return list(self._params)

    def shape(self, name: str) -> torch.Size:
        """Shape of parameter ``name``."""
        return self._param(name).shape

    def dtype(self, name: str) -> torch.dtype:
        """Dtype of parameter ``name``."""
        return self._param(name).dtype

    def read_flat(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the flattened parameter, as a fresh detached 1-D tensor."""
        param = self._param(name)
        if param.is_meta:
            raise ValueError(f"parameter {name!r} of {self!r} is on the meta device")
        check_range(name, param.numel(), lo, hi)
        return param.detach().reshape(-1)[lo:hi].clone()


def check_against_model(
    source: TensorSource,
    params: Mapping[str, tuple[Sequence[str], torch.Size]],
    allowed_extra: Sequence[str] = (),
    ignore_patterns: Sequence[str] = (),
) -> None:
    """Raise ValueError unless ``source`` holds every parameter (under some alias) with the model's shape and a
    floating-point dtype (an integer or bool tensor is never cast silently; float dtypes convert, as in
    transformers), and no
    tensor that is neither a parameter alias, in ``allowed_extra`` (buffers) nor matched by ``ignore_patterns``
    (regexes, transformers' ``_keys_to_ignore_on_load_unexpected``), as transformers' loader rejects them.

    ``params`` maps each parameter's first name to (every alias, shape). Reads headers only."""
    stored = set(source.names())
    problems: list[str] = []
    known = set(allowed_extra)
    for first, (aliases, shape) in params.items():
        known.update(aliases)
        hit = next((a for a in aliases if a in stored), None)
        if hit is None:
            problems.append(f"missing '{first}'" + (f" (or {list(aliases[1:])})" if len(aliases) > 1 else ""))
        elif source.shape(hit) != torch.Size(shape):
            problems.append(f"'{hit}' has shape {list(source.shape(hit))}, the model expects {list(shape)}")
        elif not source.dtype(hit).is_floating_point:
            problems.append(f"'{hit}' has dtype {dtype_label(source.dtype(hit))}, the model expects {FLOAT_EXPECTED}")
    unexpected = sorted(n for n in stored - known if not any(re.search(p, n) for p in ignore_patterns))
    problems += [f"unexpected '{n}'" for n in unexpected[:10]]
    if problems:
        more = f" (and {len(unexpected) - 10} more unexpected)" if len(unexpected) > 10 else ""
        raise ValueError(f"checkpoint {source!r} does not match the model: {'; '.join(problems)}{more}")

"""The on-disk format of engine checkpoints (format 2): safetensors for tensors, JSON for everything else.

Layout of ``DIR/TAG/``::

    rank_00000.safetensors  per rank: for each saved group the rank's flat range [lo, hi) of the master
                            ("GROUP/master") and of each per-element optimizer state ("GROUP/exp_avg", ...);
                            its torch/cuda RNG ("rng/torch", "rng/cuda/I"); python RNG as JSON in the header
    meta.json               world size, stage, counters, every parameter's (group, offset, numel, shape, aliases),
                            every group's padded size, every rank's ranges and tensors with their dtypes
    state.json              optimizer hyperparameters and per-group non-element state, scheduler and loss-scaler
    state.safetensors       state, client state: JSON, with tensors (e.g. a shape-[1] ``step``) in the safetensors
    manifest.json           SHA-256 of every file above; written last: a tag is complete iff it holds it

Invariants:
* Reading never unpickles anything; every file's checksum is verified before it is parsed (:func:`open_tag`).
* :func:`open_tag` checks that the metadata is self-consistent (world size > 0, ranges inside their group, every
  group's rank ranges cover ``[0, padded)`` exactly, parameters inside their group without overlap, numel =
  prod(shape)) and that every rank file holds exactly the tensors, shapes and dtypes the metadata promises; a
  failure is a :class:`CheckpointError` naming the file and the check.
* Per-element state is stored in the coordinates of the group's flat buffer, so :class:`SavedSource` serves any
  state by parameter name and element range, whatever world size or grouping reads it.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as load_bytes

from hybridzero.checkpoint.jsontree import check_plain_json, decode
from hybridzero.checkpoint.paths import MANIFEST, PRODUCER, CheckpointError, check_inside, check_tag, find_tag

FORMAT = 2
META = "meta.json"
STATE_JSON = "state.json"
STATE_TENSORS = "state.safetensors"
DS_MODEL_STATES = "mp_rank_00_model_states.pt"  # DeepSpeed's, written beside ours at stages 0-2; never read here
RANK_HEADER_KEY = "hybridzero"
_MAX_HEADER = 100_000_000  # safetensors' own limit on a header's size
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def rank_file(rank: int) -> str:
    """File name of one rank's shard."""
    return f"rank_{rank:05d}.safetensors"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, streamed."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def manifest_text(files: dict[str, str], tag: str) -> str:
    """The manifest's JSON for ``files`` (name -> sha256)."""
    return json.dumps(
        {"producer": PRODUCER, "format": FORMAT, "tag": tag, "files": dict(sorted(files.items()))}, indent=1
    )


def _fail(file: Path, check: str) -> CheckpointError:
    return CheckpointError(f"checkpoint file {file}: {check}")


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict; ValueError on a key given twice (readers disagree on which one wins)."""
    out = dict(pairs)
    seen: set[str] = set()
    for k, _ in pairs if len(out) != len(pairs) else ():
        if k in seen:
            raise ValueError(f"duplicate key {k!r}")
        seen.add(k)
    return out


def _check_safetensors_header(file: Path) -> None:
    """The JSON header of a safetensors file names each tensor once (safetensors itself keeps one silently)."""
    try:
        with file.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n > _MAX_HEADER:
                raise ValueError(f"header of {n} bytes (at most {_MAX_HEADER})")
            json.loads(f.read(n), object_pairs_hook=_unique)
    except (OSError, ValueError, RecursionError) as exc:
        raise _fail(file, f"unreadable safetensors header ({type(exc).__name__}: {exc})") from exc


def _read_json(file: Path) -> Any:
    try:
        return json.loads(file.read_text(encoding="utf-8"), object_pairs_hook=_unique)
    except FileNotFoundError as exc:
        raise _fail(file, "missing") from exc
    except (OSError, ValueError, RecursionError) as exc:
        raise _fail(file, f"unreadable JSON ({type(exc).__name__}: {exc})") from exc


def _is_int(v: Any, lo: int = 0) -> bool:
    """An int (not a bool) in ``[lo, 2**63)``: every count and offset fits int64."""
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v < 2**63


def _verify_manifest(path: Path) -> dict[str, str]:
    """The manifest's files after checking each one's SHA-256."""
    file = path / MANIFEST
    if not file.is_file() and (path / META).is_file() and any(path.glob("rank_*.pt")):
        raise CheckpointError(
            f"checkpoint {path} is in the old pickle-based format 1, which this version refuses "
            "to load (unpickling it could run code stored in the files); convert it once with "
            f"`hybridzero convert-checkpoint {path.parent} NEW_DIR --tag {path.name}` (it reads tensors "
            "and plain containers only) and load NEW_DIR"
        )
    check_inside(file, path.parent)
    manifest = _read_json(file)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(manifest, dict) or manifest.get("producer") != PRODUCER or not isinstance(files, dict):
        raise _fail(file, "not a hybridzero manifest")
    if manifest.get("format") != FORMAT:
        raise _fail(file, f"format {manifest.get('format')!r}, this version reads format {FORMAT}")
    for name, digest in files.items():
        check_tag(name, where=f"file name in {file}")
        if not (isinstance(digest, str) and len(digest) == 64):
            raise _fail(file, f"bad checksum entry for {name!r}")
        target = check_inside(path / name, path.parent)
        if not target.is_file():
            raise _fail(target, "missing (listed in the manifest)")
        if sha256_file(target) != digest:
            raise _fail(target, "checksum mismatch: the file is corrupt, truncated or was modified after saving")
    return files


def _coverage(group: str, padded: int, ranges: list[tuple[int, int, int]], file: Path) -> None:
    """The ranks' ``[lo, hi)`` of ``group`` must tile ``[0, padded)``: no gap, no overlap."""
    at = 0
    for lo, hi, r in sorted(ranges):
        if lo != at:
            what = "gap" if lo > at else "overlap"
            raise _fail(file, f"group '{group}': shard ranges have a {what} at element {min(lo, at)} (rank {r})")
        at = hi
    if at != padded:
        raise _fail(file, f"group '{group}': shard ranges end at {at}, the group has {padded} elements")


def validate_meta(meta: Any, file: Path) -> None:
    """Every consistency check on ``meta.json`` (see the module docstring); CheckpointError naming the check."""
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise _fail(file, f"not format-{FORMAT} metadata")
    world = meta.get("world_size")
    if not _is_int(world, 1):
        raise _fail(file, f"world_size must be an integer > 0, got {world!r}")
    for key in ("global_steps", "micro_steps", "skipped_steps"):
        if not _is_int(meta.get(key)):
            raise _fail(file, f"{key} must be an integer in [0, 2**63), got {meta.get(key)!r}")
    excluded = meta.get("excluded", [])
    if not isinstance(excluded, list) or not all(isinstance(n, str) for n in excluded):
        raise _fail(file, "excluded must be a list of parameter names")
    groups, ranks, params = meta.get("groups"), meta.get("ranks"), meta.get("params")
    if not isinstance(groups, dict) or not all(
        _is_int(g.get("padded_numel") if isinstance(g, dict) else None) for g in groups.values()
    ):
        raise _fail(file, "groups must map names to {'padded_numel': int >= 0}")
    if not isinstance(ranks, list) or len(ranks) != world:
        raise _fail(file, f"ranks must list one entry per rank ({world})")
    spans: dict[str, list[tuple[int, int, int]]] = {g: [] for g in groups}
    for r, entry in enumerate(ranks):
        if not isinstance(entry, dict):
            raise _fail(file, f"rank {r}: entry must be an object")
        for g, part in entry.items():
            if g not in groups or not isinstance(part, dict):
                raise _fail(file, f"rank {r}: unknown group {g!r}")
            lo: Any = part.get("lo")
            hi: Any = part.get("hi")
            keys = part.get("keys")
            if not (_is_int(lo) and _is_int(hi) and lo <= hi <= groups[g]["padded_numel"]):
                raise _fail(
                    file, f"rank {r}, group '{g}': range [{lo}, {hi}) is outside [0, {groups[g]['padded_numel']})"
                )
            if (
                not isinstance(keys, dict)
                or keys.get("master") != "float32"
                or any(d not in DTYPES for d in keys.values())
            ):
                raise _fail(
                    file,
                    f"rank {r}, group '{g}': keys must map state names to one of {sorted(DTYPES)} "
                    "with 'master' float32",
                )
            spans[g].append((lo, hi, r))
    for g, ranges in spans.items():
        _coverage(g, groups[g]["padded_numel"], ranges, file)
    _validate_params(params, groups, file)


def _validate_params(params: Any, groups: dict[str, Any], file: Path) -> None:
    if not isinstance(params, dict):
        raise _fail(file, "params must be an object")
    seen: set[str] = set()
    placed: dict[str, list[tuple[int, int, str]]] = {}
    for name, info in params.items():
        ok = (
            isinstance(info, dict)
            and info.get("group") in groups
            and _is_int(info.get("offset"))
            and _is_int(info.get("numel"))
            and isinstance(info.get("shape"), list)
            and all(_is_int(d) for d in info["shape"])
            and isinstance(info.get("aliases"), list)
            and name in info["aliases"]
            and all(isinstance(a, str) for a in info["aliases"])
        )
        if not ok:
            raise _fail(file, f"parameter '{name}': needs group (a saved group), offset, numel, shape, aliases")
        if info["numel"] != math.prod(info["shape"]):
            raise _fail(file, f"parameter '{name}': numel {info['numel']} != prod(shape {info['shape']})")
        end = info["offset"] + info["numel"]
        if end > groups[info["group"]]["padded_numel"]:
            raise _fail(
                file,
                f"parameter '{name}': [{info['offset']}, {end}) exceeds group '{info['group']}' "
                f"of {groups[info['group']]['padded_numel']} elements",
            )
        if seen & set(info["aliases"]):
            raise _fail(file, f"parameter '{name}': an alias appears twice")
        seen.update(info["aliases"])
        placed.setdefault(info["group"], []).append((info["offset"], end, name))
    for g, spans in placed.items():
        spans.sort()
        for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
            if start < end:
                raise _fail(file, f"parameters '{a}' and '{b}' overlap in group '{g}'")


@dataclass
class SavedTag:
    """A verified checkpoint tag: checksums, metadata and rank-file headers all checked (see :func:`open_tag`).

    Rank files are opened lazily through safetensors (memory-mapped); nothing is unpickled."""

    path: Path
    meta: dict[str, Any]
    handles: list[Any]

    def tensor(self, rank: int, name: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of tensor ``name`` of ``rank``'s file (a fresh tensor)."""
        return self.handles[rank].get_slice(name)[lo:hi].clone()

    def rank_state(self, rank: int) -> tuple[dict[str, torch.Tensor], Any]:
        """``rank``'s RNG tensors (``rng/...``) and the JSON of its header (python RNG)."""
        h = self.handles[rank]
        rng = {k: h.get_tensor(k) for k in h.keys() if k.startswith("rng/")}
        file = self.path / rank_file(rank)
        try:
            return rng, decode(json.loads((h.metadata() or {})[RANK_HEADER_KEY]), rng, str(file))
        except (KeyError, ValueError, RecursionError) as exc:
            raise _fail(file, f"header without valid '{RANK_HEADER_KEY}' JSON ({type(exc).__name__}: {exc})") from exc

    def state(self) -> dict[str, Any]:
        """The decoded ``state.json`` with its tensors (optimizer, scheduler, loss scaler, client state)."""
        _check_safetensors_header(self.path / STATE_TENSORS)
        try:
            tensors = load_bytes((self.path / STATE_TENSORS).read_bytes())
        except (OSError, SafetensorError) as exc:
            raise _fail(self.path / STATE_TENSORS, f"unreadable safetensors ({exc})") from exc
        try:
            state = decode(_read_json(self.path / STATE_JSON), tensors, str(self.path / STATE_JSON))
        except (ValueError, RecursionError) as exc:
            raise _fail(self.path / STATE_JSON, f"{type(exc).__name__}: {exc}") from exc
        if not isinstance(state, dict) or not {"optimizer", "scheduler", "loss_scaler", "client_state"} <= set(state):
            raise _fail(self.path / STATE_JSON, "needs optimizer, scheduler, loss_scaler and client_state")
        try:
            check_plain_json(state["client_state"])
        except (TypeError, RecursionError) as exc:
            raise _fail(self.path / STATE_JSON, f"{type(exc).__name__}: {exc}") from exc
        return state


def _check_rank_file(path: Path, rank: int, entry: dict[str, Any]) -> Any:
    file = path / rank_file(rank)
    _check_safetensors_header(file)
    try:
        handle = safe_open(str(file), framework="pt")
    except (OSError, SafetensorError) as exc:
        raise _fail(file, f"unreadable safetensors ({exc})") from exc
    for g, part in entry.items():
        for key, dtype in part["keys"].items():
            name = f"{g}/{key}"
            if name not in handle.keys():
                raise _fail(file, f"tensor '{name}' listed in {META} is missing")
            sl = handle.get_slice(name)
            if sl.get_shape() != [part["hi"] - part["lo"]]:
                raise _fail(
                    file, f"tensor '{name}' has shape {sl.get_shape()}, {META} says [{part['hi'] - part['lo']}]"
                )
            got = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}.get(sl.get_dtype())
            if got != dtype:
                raise _fail(file, f"tensor '{name}' has dtype {sl.get_dtype()}, {META} says {dtype}")
    return handle


def open_tag(path: Path) -> SavedTag:
    """Verify the tag at ``path`` completely (checksums, metadata, rank-file headers) and open it for reading."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a directory")
    check_inside(path, path.parent)
    files = _verify_manifest(path)
    meta = _read_json(path / META)
    validate_meta(meta, path / META)
    expected = {META, STATE_JSON, STATE_TENSORS} | {rank_file(r) for r in range(meta["world_size"])}
    expected |= {DS_MODEL_STATES} & set(files)  # checked above like every listed file; its content is not read
    if set(files) != expected:
        raise _fail(path / MANIFEST, f"lists {sorted(files)}, expected {sorted(expected)}")
    handles = [_check_rank_file(path, r, entry) for r, entry in enumerate(meta["ranks"])]
    return SavedTag(path, meta, handles)


class SavedSource:
    """Per-element state ``key`` of a verified tag, readable by parameter name and element range
    (a :class:`~hybridzero.tensor_source.TensorSource`). Elements no rank saved for ``key`` read as zero."""

    def __init__(self, tag: SavedTag, key: str) -> None:
        self.tag, self.key = tag, key
        self._info = {alias: info for info in tag.meta["params"].values() for alias in info["aliases"]}

    def __repr__(self) -> str:
        return f"SavedSource({str(self.tag.path)!r}, {self.key!r})"

    def names(self) -> list[str]:
        """Saved parameter names (every alias)."""
        return list(self._info)

    def _lookup(self, name: str) -> dict[str, Any]:
        if name not in self._info:
            raise KeyError(f"parameter '{name}' is not in checkpoint {self.tag.path}")
        return self._info[name]

    def shape(self, name: str) -> torch.Size:
        """Saved shape of ``name``."""
        return torch.Size(self._lookup(name)["shape"])

    def dtype(self, name: str) -> torch.dtype:
        """Values are served in fp32 (every stored dtype converts exactly)."""
        return torch.float32

    def read_flat(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of ``name``'s flattened state, assembled from every rank file that holds some."""
        info = self._lookup(name)
        if not 0 <= lo <= hi <= info["numel"]:
            raise ValueError(f"range [{lo}, {hi}) outside parameter '{name}' of {info['numel']} elements")
        out = torch.zeros(hi - lo, dtype=torch.float32)
        start, stop = info["offset"] + lo, info["offset"] + hi
        for rank, entry in enumerate(self.tag.meta["ranks"]):
            part = entry.get(info["group"])
            if part is None or self.key not in part["keys"]:
                continue
            a, b = max(start, part["lo"]), min(stop, part["hi"])
            if a < b:
                piece = self.tag.tensor(rank, f"{info['group']}/{self.key}", a - part["lo"], b - part["lo"])
                out[a - start : b - start].copy_(piece)
        return out


def verify_tag(root: str | Path, tag: str | None = None) -> Path:
    """Check that checkpoint ``tag`` (default: the one ``latest`` names) under ``root`` is complete and valid —
    manifest, every file's SHA-256, metadata consistency, rank-file headers, state JSON — without loading it into
    an engine. Returns its directory; raises :class:`CheckpointError` naming the file and the check. Local (no
    collective); reads every byte of the tag once."""
    path = find_tag(root, tag)
    if path is None:
        raise CheckpointError(f"no checkpoint {'latest' if tag is None else repr(tag)} in {root}")
    open_tag(path).state()
    return path

"""Convert a checkpoint of the earlier pickle-based format 1 into format 2 (:mod:`hybridzero.checkpoint.format`),
file to file: no engine, no process group (``hybridzero convert-checkpoint OLD_DIR NEW_DIR [--tag TAG]``).

Format 1 (hybridzero before format 2), in ``OLD_DIR/TAG/``::

    meta.json       {"format": 1, "tag", "world_size", "stage", "global_steps", "micro_steps", "skipped_steps",
                     "params": {name: {group, offset, numel, shape, aliases}}, "groups": {name: {padded_numel,
                     mode}}, "optimizer": class name or null, "hf_config", "model_class"}
    extra.pt        torch.save({"scalars": {param-group index: {key: number}}, "client_state", "param_groups":
                    [hyperparameters], "scheduler": state_dict | None, "loss_scaler": state_dict})
    rank_NNNNN.pt   torch.save({"rank": r, "groups": {group: {"lo", "hi", "tensors": {"master" | state key: 1-D
                    tensor over [lo, hi)}}}, "rng": {"torch": uint8 tensor, "python": random.getstate(),
                    "cuda": [uint8 tensors] | None}})

Invariants:
* Files are read only with ``torch.load(weights_only=True, mmap=True)``: nothing but tensors and plain containers
  is ever unpickled; a file that needs more (a crafted ``__reduce__``), or is not a torch zip archive, is refused
  naming it. Only regular files inside the tag directory are read (no symlinks); tags and ``latest`` are validated
  as in format 2.
* Everything the format-2 loader checks is checked before anything is published: world size, every rank file's
  ranges, tensor shapes and dtypes, the shard ranges covering each group, parameter offsets and numels
  (:func:`~hybridzero.checkpoint.format.validate_meta`), optimizer/scheduler/scaler state storable as JSON, RNG
  state; then the written tag is re-opened and verified with :func:`~hybridzero.checkpoint.format.open_tag`.
* Nothing is written under ``OLD_DIR``. ``NEW_DIR`` is absent, empty or holds only format-2 checkpoints (and
  ``latest``); an existing tag of the same name is never replaced. The tag is built under ``TAG.partial-<nonce>``
  through the engine's own writer (:mod:`hybridzero.checkpoint.writer`) and published atomically; a failure removes
  what was written (and ``NEW_DIR`` itself when the conversion created it).
* ``NEW_DIR/latest`` names the converted tag when ``OLD_DIR/latest`` names it or ``NEW_DIR`` had no ``latest``.
* Values are carried exactly: every tensor bit for bit; a format-1 scalar optimizer state (Adam's ``step``, saved
  as a Python float) becomes the 0-dim float32 tensor the format-1 loader made of it, on the parameter's device
  when the group is ``capturable``/``fused``.
"""

from __future__ import annotations

import builtins
import json
import os
import random
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

from hybridzero.checkpoint.format import DTYPES, META, dtype_name, open_tag, rank_file, validate_meta
from hybridzero.checkpoint.jsontree import check_plain_json, encode
from hybridzero.checkpoint.paths import (
    LATEST,
    MANIFEST,
    PARTIAL,
    CheckpointError,
    check_tag,
    find_tag,
    is_ours,
    publish,
    read_latest,
    write_latest,
)
from hybridzero.checkpoint.recovery import is_our_script
from hybridzero.checkpoint.writer import write_rank_file, write_shared_files

__all__ = ["EXTRA", "convert_v1", "v1_rank_file"]

EXTRA = "extra.pt"
_EXTRA_KEYS = ("scalars", "client_state", "param_groups", "scheduler", "loss_scaler")
_ZIP_MAGIC = b"PK\x03\x04"


def v1_rank_file(rank: int) -> str:
    """Format-1 file name of one rank's shard."""
    return f"rank_{rank:05d}.pt"


def _is_rank_file(name: str, world: int) -> bool:
    """True if ``name`` is the format-1 file of a rank below ``world``."""
    digits = name.removeprefix("rank_").removesuffix(".pt")
    return digits.isdigit() and int(digits) < world and name == v1_rank_file(int(digits))


def _fail(file: Path, check: str) -> CheckpointError:
    return CheckpointError(f"format-1 checkpoint file {file}: {check}")


def _regular_file(tag_dir: Path, name: str) -> Path:
    """``tag_dir/name`` if it is a regular file (not a symlink: nothing outside the tag directory is read)."""
    file = tag_dir / name
    if file.is_symlink() or not file.is_file():
        raise _fail(file, "missing or not a regular file (symbolic links are refused)")
    return file


def _refusal(exc: Exception) -> str:
    """The reason of a refused ``torch.load`` in one line (torch's own advice to unpickle the file is dropped)."""
    text = str(exc)
    hit = re.search(r"\bGLOBAL ([\w.]+)", text, flags=re.IGNORECASE)  # torch's wording varies between versions
    if hit:
        name = hit.group(1)
        alias = re.sub(r"^(posix|nt)\.", "os.", name) if "." in name else f"builtins.{name}"
        alias = alias if "." in name or hasattr(builtins, name) else name
        shown = f"'{name}'" + (f" ({alias})" if alias != name else "")
        return f"it needs the blocked global {shown} to load, and only tensors and plain containers are read"
    boilerplate = ("weights only load failed", "check the documentation", "re-running", "in pytorch")
    reasons = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().lower().startswith(boilerplate)]
    if reasons:
        return reasons[0][:300]
    return text.strip().splitlines()[-1][:300] if text.strip() else type(exc).__name__


def load_pt(file: Path) -> Any:
    """A format-1 ``.pt`` file through ``torch.load(weights_only=True, mmap=True)``; CheckpointError naming it."""
    try:
        with file.open("rb") as f:
            magic = f.read(len(_ZIP_MAGIC))
    except OSError as exc:
        raise _fail(file, f"unreadable ({exc})") from exc
    if magic != _ZIP_MAGIC:
        raise _fail(file, "refused: not a torch.save zip archive (format 1 always wrote one); nothing was unpickled")
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling/zip error means the file is refused, never retried
        raise _fail(file, f"refused: {_refusal(exc)}") from exc


def _is_int(v: Any, lo: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def read_v1_meta(tag_dir: Path) -> dict[str, Any]:
    """``meta.json`` of a format-1 tag, with the structure the rank files are checked against."""
    file = _regular_file(tag_dir, META)
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise _fail(file, f"unreadable JSON ({exc})") from exc
    if not isinstance(meta, dict) or meta.get("format") != 1:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise _fail(file, f"not format-1 metadata ('format' is {got!r}, expected 1)")
    if not _is_int(meta.get("world_size"), 1):
        raise _fail(file, f"world_size must be an integer > 0, got {meta.get('world_size')!r}")
    groups = meta.get("groups")
    if not isinstance(groups, dict) or not all(
        isinstance(g, dict) and _is_int(g.get("padded_numel")) for g in groups.values()
    ):
        raise _fail(file, "groups must map names to {'padded_numel': int >= 0, ...}")
    if not (meta.get("optimizer") is None or isinstance(meta["optimizer"], str)):
        raise _fail(file, f"optimizer must be a class name or null, got {meta['optimizer']!r}")
    return meta


def read_v1_state(tag_dir: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """``extra.pt`` as the format-2 ``state`` (optimizer, scheduler, loss_scaler, client_state), checked to be
    storable (plain JSON client state; every other value JSON or tensors)."""
    file = _regular_file(tag_dir, EXTRA)
    extra = load_pt(file)
    if not isinstance(extra, dict) or not set(_EXTRA_KEYS) <= set(extra):
        got = sorted(map(str, extra)) if isinstance(extra, dict) else type(extra).__name__
        raise _fail(file, f"needs the keys {list(_EXTRA_KEYS)}, has {got}")
    pgs, scalars = extra["param_groups"], extra["scalars"]
    if not isinstance(pgs, list) or not all(isinstance(g, dict) and all(isinstance(k, str) for k in g) for g in pgs):
        raise _fail(file, "param_groups must be a list of hyperparameter dicts")
    if not isinstance(scalars, dict) or not all(
        _is_int(k) and k < len(pgs) and isinstance(v, dict) and all(isinstance(n, str) for n in v)
        for k, v in scalars.items()
    ):
        raise _fail(file, f"scalars must map param-group indices (0..{len(pgs) - 1}) to dicts of named values")
    if not (extra["scheduler"] is None or isinstance(extra["scheduler"], dict)):
        raise _fail(file, "scheduler must be a state_dict or None")
    if not isinstance(extra["loss_scaler"], dict):
        raise _fail(file, "loss_scaler must be a state_dict")
    client_state = {} if extra["client_state"] is None else extra["client_state"]
    other = {str(k): {key: _scalar(v, pgs[k]) for key, v in values.items()} for k, values in scalars.items()}
    optimizer = None if meta["optimizer"] is None else {"class": meta["optimizer"], "state": other, "param_groups": pgs}
    state = {
        "optimizer": optimizer,
        "scheduler": extra["scheduler"],
        "loss_scaler": extra["loss_scaler"],
        "client_state": client_state,
    }
    try:
        check_plain_json(client_state)
        encode(state, {}, "")  # what the writer will store: fails now, before anything is written
    except TypeError as exc:
        raise _fail(file, f"{exc} (format 2 stores this state as JSON)") from exc
    return state


def _scalar(value: Any, hyper: dict[str, Any]) -> dict[str, Any]:
    """A format-1 scalar optimizer state in format 2: a float becomes the 0-dim float32 tensor format 1's loader
    made of it, on the parameter's device when the group is capturable or fused."""
    on_device = bool(hyper.get("capturable") or hyper.get("fused"))
    if isinstance(value, float):
        return {"value": torch.tensor(value, dtype=torch.float32), "on_param_device": on_device}
    return {"value": value, "on_param_device": on_device and isinstance(value, torch.Tensor)}


def _tensor(file: Path, where: str, t: Any, length: int | None, dtypes: tuple[str, ...]) -> torch.Tensor:
    """A contiguous copy of ``t`` after checking it is a dense 1-D CPU tensor of ``length`` and one of ``dtypes``."""
    ok = isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type == "cpu" and t.dim() == 1
    if not ok:
        raise _fail(file, f"{where} must be a dense 1-D tensor, got {type(t).__name__}")
    if length is not None and t.numel() != length:
        raise _fail(file, f"{where} has {t.numel()} elements, its range [lo, hi) has {length}")
    if dtype_name(t.dtype) not in dtypes:
        raise _fail(file, f"{where} has dtype {dtype_name(t.dtype)}, expected one of {list(dtypes)}")
    return t.contiguous().clone()


def _rank_groups(
    file: Path, parts: Any, groups: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """The tensors (``GROUP/KEY``) and the format-2 ``ranks`` entry of one rank file's ``groups``."""
    if not isinstance(parts, dict):
        raise _fail(file, "'groups' must be a dict")
    tensors: dict[str, torch.Tensor] = {}
    entry: dict[str, dict[str, Any]] = {}
    for g, part in parts.items():
        if g not in groups or not isinstance(part, dict) or not isinstance(part.get("tensors"), dict):
            raise _fail(file, f"group {g!r} is not in {META} or is not {{'lo', 'hi', 'tensors'}}")
        lo: Any = part.get("lo")
        hi: Any = part.get("hi")
        padded = groups[g]["padded_numel"]
        if not (_is_int(lo) and _is_int(hi) and lo <= hi <= padded):
            raise _fail(file, f"group '{g}': range [{lo!r}, {hi!r}) is outside [0, {padded}]")
        if "master" not in part["tensors"]:
            raise _fail(file, f"group '{g}': no 'master' tensor")
        keys = {}
        for key, t in part["tensors"].items():
            if not isinstance(key, str) or not key or "/" in key or f"{g}/{key}" in tensors:
                raise _fail(file, f"group '{g}': bad state name {key!r}")
            dtypes = ("float32",) if key == "master" else tuple(DTYPES)
            tensors[f"{g}/{key}"] = _tensor(file, f"group '{g}' tensor '{key}'", t, hi - lo, dtypes)
            keys[key] = dtype_name(t.dtype)
        entry[g] = {"lo": lo, "hi": hi, "keys": {"master": keys.pop("master"), **keys}}
    return tensors, entry


def _rank_rng(file: Path, rng: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Adds ``rng/torch`` and ``rng/cuda/I`` to ``tensors``; returns the checked python RNG state."""
    if not isinstance(rng, dict) or not {"torch", "python", "cuda"} <= set(rng):
        raise _fail(file, "'rng' must hold 'torch', 'python' and 'cuda'")
    if "rng/torch" in tensors:
        raise _fail(file, "a group named 'rng' collides with the RNG state")
    tensors["rng/torch"] = _tensor(file, "rng 'torch'", rng["torch"], None, ("uint8",))
    cuda = rng["cuda"]
    if not (cuda is None or isinstance(cuda, (list, tuple))):
        raise _fail(file, "rng 'cuda' must be a list of tensors or None")
    for i, state in enumerate(cuda or []):
        tensors[f"rng/cuda/{i}"] = _tensor(file, f"rng 'cuda'[{i}]", state, None, ("uint8",))
    try:
        random.Random().setstate(rng["python"])
    except (TypeError, ValueError) as exc:
        raise _fail(file, f"rng 'python' is not a random.getstate() value ({exc})") from exc
    return rng["python"]


def convert_rank(tag_dir: Path, partial: Path, rank: int, groups: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Read, check and rewrite one rank's file; returns the new file's SHA-256 and its ``ranks`` entry."""
    file = _regular_file(tag_dir, v1_rank_file(rank))
    payload = load_pt(file)
    if not isinstance(payload, dict) or payload.get("rank") != rank:
        got = payload.get("rank") if isinstance(payload, dict) else type(payload).__name__
        raise _fail(file, f"holds rank {got!r}, expected {rank}")
    tensors, entry = _rank_groups(file, payload.get("groups"), groups)
    python_rng = _rank_rng(file, payload.get("rng"), tensors)
    del payload  # drop the memory map before writing
    return write_rank_file(partial, rank, tensors, python_rng), entry


def _new_meta(old: dict[str, Any], tag: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Format-2 ``meta.json`` from format 1's and the rank entries (format 1 always saved every group)."""
    keep = ("world_size", "stage", "global_steps", "micro_steps", "skipped_steps", "params", "groups")
    return {
        "format": 2,
        "tag": tag,
        **{k: old.get(k) for k in keep},
        "excluded": [],
        "ranks": ranks,
        "optimizer": old.get("optimizer"),
        "hf_config": old.get("hf_config"),
        "model_class": old.get("model_class"),
        "converted_from": {"format": 1, "tag": old.get("tag")},
    }


def _source(old_root: Path, tag: str | None) -> Path:
    """The format-1 tag directory to convert (``tag``, default: the one ``OLD_DIR/latest`` names)."""
    if not old_root.is_dir():
        raise CheckpointError(f"{old_root} does not exist or is not a directory")
    path = find_tag(old_root, None if tag is None else check_tag(tag))
    if path is None or not path.is_dir():
        what = f"tag {tag!r}" if tag is not None else f"'{LATEST}' file"
        raise CheckpointError(f"no {what} in {old_root}: give the tag to convert with --tag")
    if (path / MANIFEST).exists():
        raise CheckpointError(f"{path} is already a format-2 checkpoint ({MANIFEST}): load it as it is")
    return path


def _latest_or_none(root: Path) -> str | None:
    """The tag ``root/latest`` names, or None if there is none or it is not a valid tag (then it is ignored)."""
    try:
        return read_latest(root)
    except CheckpointError:
        return None


def _entry_is_ours(p: Path) -> bool:
    """A ``NEW_DIR`` entry a checkpoint directory may hold: ``latest``, a format-2 tag, a partial write, the
    recovery script a save leaves (:mod:`hybridzero.checkpoint.recovery`)."""
    if p.name == LATEST:
        return p.is_file() and not p.is_symlink()
    if is_our_script(p):
        return True
    return is_ours(p) or (PARTIAL in p.name and p.is_dir() and not p.is_symlink())


def _check_destination(old_root: Path, new_root: Path, tag: str) -> None:
    """Refuse a ``NEW_DIR`` inside ``OLD_DIR``, one that is not (or not only) a checkpoint directory, or that
    already holds ``tag``."""
    src, dst = old_root.resolve(), new_root.resolve()
    if dst == src or src in dst.parents:
        raise CheckpointError(f"NEW_DIR {new_root} is inside OLD_DIR {old_root}: the converter never writes there")
    if new_root.exists() or new_root.is_symlink():
        if not new_root.is_dir():
            raise CheckpointError(f"NEW_DIR {new_root} exists and is not a directory")
        foreign = sorted(p.name for p in new_root.iterdir() if not _entry_is_ours(p))
        if foreign:
            raise CheckpointError(
                f"NEW_DIR {new_root} exists and is not a hybridzero checkpoint directory (it holds {foreign[:3]}): "
                "give a new or empty directory, or one holding only format-2 checkpoints"
            )
    target = new_root / tag
    if target.exists() or target.is_symlink():
        raise CheckpointError(f"NEW_DIR {new_root} already holds tag '{tag}': remove it or convert into another dir")


def _write(tag_dir: Path, partial: Path, tag: str) -> None:
    """Read, check and write every file of the tag into ``partial``; then verify ``partial`` as a loader would."""
    meta = read_v1_meta(tag_dir)
    state = read_v1_state(tag_dir, meta)
    world = meta["world_size"]
    unexpected = sorted(p.name for p in tag_dir.glob("rank_*.pt") if not _is_rank_file(p.name, world))
    if unexpected:
        raise _fail(tag_dir / unexpected[0], f"unexpected: {META} says world_size {world}")
    digests, ranks = {}, []
    for r in range(world):
        digest, entry = convert_rank(tag_dir, partial, r, meta["groups"])
        digests[rank_file(r)] = digest
        ranks.append(entry)
    new_meta = _new_meta(meta, tag, ranks)
    try:
        validate_meta(new_meta, tag_dir / META)
    except CheckpointError as exc:
        raise CheckpointError(f"format-1 {exc} (ranges as read from the rank files)") from exc
    write_shared_files(partial, tag, state, new_meta, digests)
    open_tag(partial).state()  # the written tag passes every check a load makes before it reads the engine


def convert_v1(old_dir: str | os.PathLike[str], new_dir: str | os.PathLike[str], tag: str | None = None) -> Path:
    """Convert format-1 checkpoint ``tag`` (default: the one ``old_dir/latest`` names) into a format-2 checkpoint
    of the same tag under ``new_dir``; returns the new tag directory. Local, no engine or process group.

    Raises :class:`CheckpointError` naming the file and the check for anything refused (see the module
    docstring); then nothing is left in ``new_dir`` and ``old_dir`` is never written."""
    old_root, new_root = Path(old_dir), Path(new_dir)
    tag_dir = _source(old_root, tag)
    tag = check_tag(tag_dir.name)
    _check_destination(old_root, new_root, tag)
    old_latest = _latest_or_none(old_root)
    created = not new_root.exists()
    nonce = uuid.uuid4().hex
    partial = new_root / f"{tag}{PARTIAL}{nonce}"
    try:
        partial.mkdir(parents=True)
        _write(tag_dir, partial, tag)
        final = publish(new_root, partial, tag, nonce)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        if created:
            shutil.rmtree(new_root, ignore_errors=True)
        raise
    if old_latest == tag or not (new_root / LATEST).exists():
        write_latest(new_root, tag, nonce)
    return final

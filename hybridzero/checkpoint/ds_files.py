"""Reading the files of a DeepSpeed (0.19.x) ZeRO checkpoint without running code stored in them.

Layout of a DeepSpeed save directory ``DS_DIR``::

    latest                                        the newest tag's name (text)
    TAG/mp_rank_00_model_states.pt                ZeRO-1/2: module state, param_shapes, lr_scheduler, counters
    TAG/zero_pp_rank_R_mp_rank_00_model_states.pt ZeRO-3: the same per rank (the module's tensors are empty)
    TAG/[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt
                                                  per data-parallel rank R: its flat fp32 partition(s) and
                                                  Adam state of the same partition(s)

Invariants:
* Files are read only with ``torch.load(weights_only=True, mmap=True)``. DeepSpeed 0.19.8 pickles three of its own
  classes in ``*_optim_states.pt``: ``deepspeed.runtime.zero.config.ZeroStageEnum`` (an int enum),
  ``deepspeed.runtime.fp16.loss_scaler.LossScaler`` (a loss scaler object) and
  ``deepspeed.utils.tensor_fragment.fragment_address`` (a dataclass of two ints). Exactly these names are allowed,
  each mapped to an inert stand-in of ours that keeps plain numbers only (:data:`ALLOWED_GLOBALS`); DeepSpeed is
  never imported. A file needing any other global is refused with a :class:`CheckpointError` naming the global.
* Only regular files directly inside the tag directory, itself a real directory directly inside ``DS_DIR``, are
  read: no symbolic links, no tag with a path separator (see :func:`hybridzero.checkpoint.paths.check_tag`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from hybridzero.checkpoint.paths import LATEST, MANIFEST, CheckpointError, check_tag

__all__ = [
    "ALLOWED_GLOBALS",
    "DSFragment",
    "DSLossScaler",
    "DSZeroStage",
    "ds_tag_dir",
    "is_deepspeed_dir",
    "load_ds_file",
    "model_states_file",
    "optim_states_file",
    "refuse_deepspeed_dir",
]

_ZIP_MAGIC = b"PK\x03\x04"
_PLAIN = (bool, int, float, str, type(None))


class DSZeroStage(int):
    """Stand-in for ``deepspeed.runtime.zero.config.ZeroStageEnum``: the stage number (0-3)."""

    def __new__(cls, value: Any) -> DSZeroStage:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 3:
            raise ValueError(f"ZeroStageEnum value must be 0..3, got {value!r}")
        return super().__new__(cls, value)


class _PlainState:
    """An object DeepSpeed pickled, reduced to its attributes that are plain numbers, strings or None."""

    state: dict[str, Any]

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict):
            raise ValueError(f"{type(self).__name__}: pickled state must be a dict, got {type(state).__name__}")
        self.state = {str(k): v for k, v in state.items() if isinstance(v, _PLAIN)}


class DSLossScaler(_PlainState):
    """Stand-in for ``deepspeed.runtime.fp16.loss_scaler.LossScaler`` / ``DynamicLossScaler``'s pickled state
    (``cur_scale``, ``cur_iter``, ``last_overflow_iter``, ``cur_hysteresis``, ``dynamic``, ...)."""


class DSFragment(_PlainState):
    """Stand-in for ``deepspeed.utils.tensor_fragment.fragment_address`` (``numel``, ``start``)."""


ALLOWED_GLOBALS: list[tuple[type, str]] = [
    (DSZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (DSLossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (DSLossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (DSFragment, "deepspeed.utils.tensor_fragment.fragment_address"),
]


def _fail(file: Path, check: str) -> CheckpointError:
    return CheckpointError(f"DeepSpeed checkpoint file {file}: {check}")


def _refusal(exc: Exception) -> str:
    """One line for a refused ``torch.load`` (torch's advice to unpickle the file is dropped)."""
    text = str(exc)
    hit = re.search(r"Unsupported global: GLOBAL (\S+)", text)
    if hit:
        return (
            f"it needs the global '{hit.group(1)}' to load; only tensors, plain containers and "
            f"{sorted({name for _, name in ALLOWED_GLOBALS})} are read"
        )
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else type(exc).__name__


def _regular(tag_dir: Path, name: str) -> Path:
    file = tag_dir / name
    if file.is_symlink() or not file.is_file():
        raise _fail(file, "missing or not a regular file (symbolic links are refused)")
    return file


def load_ds_file(tag_dir: Path, name: str) -> Any:
    """``tag_dir/name`` through ``torch.load(weights_only=True)`` with :data:`ALLOWED_GLOBALS` only."""
    file = _regular(tag_dir, name)
    try:
        with file.open("rb") as f:
            magic = f.read(len(_ZIP_MAGIC))
    except OSError as exc:
        raise _fail(file, f"unreadable ({exc})") from exc
    if magic != _ZIP_MAGIC:
        raise _fail(file, "refused: not a torch.save zip archive; nothing was unpickled")
    try:
        with torch.serialization.safe_globals(ALLOWED_GLOBALS):  # type: ignore[arg-type]
            return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling/zip error means the file is refused, never retried
        raise _fail(file, f"refused: {_refusal(exc)}") from exc


def model_states_file(stage: int, rank: int) -> str:
    """Name of the model-states file DeepSpeed writes at ``stage`` (rank 0's at ZeRO-1/2)."""
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"


def optim_states_file(rank: int, bf16: bool) -> str:
    """Name of rank ``rank``'s optimizer-states file (``bf16_`` prefix for DeepSpeed's bf16 optimizer)."""
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def _looks_like_tag(path: Path) -> bool:
    """A DeepSpeed tag: its model-states file, and no hybridzero manifest (hybridzero writes DeepSpeed's
    ``mp_rank_00_model_states.pt`` beside its own files at stages 0-2)."""
    return (
        path.is_dir()
        and not (path / MANIFEST).exists()
        and ((path / "mp_rank_00_model_states.pt").is_file() or (path / model_states_file(3, 0)).is_file())
    )


def ds_tag_dir(ds_dir: Path, tag: str | None) -> Path:
    """The tag directory to read: ``tag``, or the one ``ds_dir/latest`` names; CheckpointError when there is none,
    it is not a DeepSpeed tag, or a path in between is a symbolic link."""
    if ds_dir.is_symlink() or not ds_dir.is_dir():
        raise CheckpointError(f"{ds_dir} does not exist or is not a directory")
    if tag is None:
        latest = ds_dir / LATEST
        if latest.is_symlink() or not latest.is_file():
            raise CheckpointError(f"no '{LATEST}' file in {ds_dir}: give the tag to convert with --tag")
        tag = latest.read_text(encoding="utf-8", errors="replace").strip()
    check_tag(tag, where=f"tag in {ds_dir}")
    path = ds_dir / tag
    if path.is_symlink() or not _looks_like_tag(path):
        raise CheckpointError(
            f"{path} is not a DeepSpeed ZeRO checkpoint tag (no mp_rank_00_model_states.pt or "
            "zero_pp_rank_0_mp_rank_00_model_states.pt; symbolic links are refused)"
        )
    return path


def is_deepspeed_dir(path: Path) -> bool:
    """True if ``path`` looks like a DeepSpeed save directory (its ``latest`` names a DeepSpeed tag) or tag."""
    if _looks_like_tag(path):
        return True
    latest = path / LATEST
    if not latest.is_file():
        return False
    name = latest.read_text(encoding="utf-8", errors="replace").strip()
    return bool(name) and "/" not in name and name not in (".", "..") and _looks_like_tag(path / name)


def refuse_deepspeed_dir(load_dir: Path, tag: str | None) -> None:
    """CheckpointError telling how to convert when ``load_dir`` (or its ``tag``) is a DeepSpeed save directory."""
    target = load_dir / tag if tag is not None and "/" not in tag else load_dir
    if is_deepspeed_dir(target) or is_deepspeed_dir(load_dir):
        where = f" --tag {tag}" if tag is not None else ""
        raise CheckpointError(
            f"{load_dir} is a DeepSpeed checkpoint, which the engine does not load directly: convert it once with "
            f"`hybridzero convert-checkpoint --from deepspeed {load_dir} NEW_DIR{where}` and load NEW_DIR"
        )

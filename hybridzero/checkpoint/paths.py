"""Where a checkpoint lives: tag names, the ``latest`` pointer, completeness, atomic publication.

Invariants:
* A tag is one path component: a non-empty string without separators, control characters or a ``.partial-``
  part, and not ``.``, ``..`` or ``latest``. ``latest`` is read as a tag and checked the same way, so nothing
  read from disk or passed by a caller can name a path outside the save directory; a tag directory, ``latest`` or
  a file of a tag that is a symbolic link out of the save directory is refused (:func:`check_inside`).
* A tag directory is *ours* (complete, ours to replace) only when it holds a ``manifest.json`` of this format.
  A directory that is not ours is never deleted or replaced.
* Publication is atomic: a tag is built under ``TAG.partial-<nonce>`` and renamed into place; an older version of
  the tag is moved aside first and removed after, so at every moment a complete version exists under some name.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from pathlib import Path

LATEST = "latest"
PARTIAL = ".partial-"
MANIFEST = "manifest.json"
PRODUCER = "hybridzero"
_LATEST_MAX_BYTES = 4096


class CheckpointError(ValueError):
    """A checkpoint (or a tag, or a ``latest`` file) is missing, incomplete, corrupt or inconsistent.

    The message names the file and the check that failed."""


def check_tag(tag: object, where: str = "tag") -> str:
    """``tag`` if it is a valid single path component, else CheckpointError saying what is wrong and what is valid."""
    valid = "a non-empty name without '/', '\\', control characters or '.partial-', other than '.', '..', 'latest'"
    if not isinstance(tag, str):
        raise CheckpointError(f"{where} {tag!r} must be a string: {valid}")
    bad = ""
    if not tag or tag in (".", "..", LATEST):
        bad = "a reserved or empty name"
    elif "/" in tag or "\\" in tag or (os.sep in tag) or (os.altsep and os.altsep in tag):
        bad = "a path separator (tags are single directory names inside the save directory)"
    elif any(ord(c) < 32 or ord(c) == 127 for c in tag):
        bad = "a control character"
    elif PARTIAL in tag:
        bad = f"'{PARTIAL}' (reserved for checkpoints being written)"
    elif len(tag.encode("utf-8", "surrogatepass")) > 255:
        bad = "more than 255 bytes"
    if bad:
        raise CheckpointError(f"invalid checkpoint {where} {tag!r}: it contains {bad}; use {valid}")
    return tag


def check_inside(path: Path, root: Path) -> Path:
    """``path`` unless it is a symbolic link whose target lies outside ``root`` (both resolved), which raises
    CheckpointError naming both: a checkpoint never makes the loader read a file outside its save directory."""
    if path.is_symlink():
        target, base = path.resolve(), root.resolve()
        if not target.is_relative_to(base):
            raise CheckpointError(
                f"checkpoint path {path} is a symbolic link to {target}, outside the save directory {base}; "
                "refusing to follow it (copy the files into the save directory instead)"
            )
    return path


def read_latest(root: str | os.PathLike[str]) -> str | None:
    """The tag ``root/latest`` names (validated like any tag), or None if there is no ``latest`` file."""
    file = Path(root) / LATEST
    if not file.exists() and not file.is_symlink():
        return None
    check_inside(file, Path(root))
    if not file.is_file():
        raise CheckpointError(f"{file} is not a regular file")
    data = file.read_bytes()
    if len(data) > _LATEST_MAX_BYTES:
        raise CheckpointError(f"{file} holds {len(data)} bytes; a tag name is at most 255")
    try:
        text = data.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{file} is not UTF-8 text: {exc}") from exc
    return check_tag(text, where=f"tag in {file}")


def is_ours(path: Path) -> bool:
    """True if ``path`` is a (non-symlink) directory holding a manifest written by this checkpoint format."""
    if path.is_symlink() or not path.is_dir():
        return False
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("producer") == PRODUCER


def list_tags(root: str | os.PathLike[str]) -> list[str]:
    """Complete tags under ``root``, sorted (directories with our manifest; partial writes never count).

    Cheap: reads one small file per directory. :func:`hybridzero.checkpoint.verify_tag` checks a tag fully."""
    base = Path(root)
    if not base.is_dir():
        return []
    out = []
    for p in base.iterdir():
        try:
            check_tag(p.name)
        except CheckpointError:
            continue
        if is_ours(p):
            out.append(p.name)
    return sorted(out)


def tag_path(root: str | os.PathLike[str], tag: str) -> Path:
    """``root/tag`` after validating ``tag``."""
    return Path(root) / check_tag(tag)


def check_replaceable(root: Path, tag: str) -> None:
    """Raise unless ``root/tag`` is absent or one of our checkpoints (a save never deletes anything else)."""
    final = tag_path(root, tag)
    if (final.exists() or final.is_symlink()) and not is_ours(final):
        raise CheckpointError(
            f"{final} exists and is not a hybridzero checkpoint (no {MANIFEST} of ours); "
            "refusing to replace it: choose another tag or save directory"
        )
    if (root / LATEST).exists() and not (root / LATEST).is_file():
        raise CheckpointError(f"{root / LATEST} exists and is not a file; refusing to replace it")


def publish(root: Path, partial: Path, tag: str, nonce: str) -> Path:
    """Rename the complete ``partial`` directory to ``root/tag`` (replacing an older version of ours atomically)."""
    final = tag_path(root, tag)
    check_replaceable(root, tag)
    old = root / f"{tag}{PARTIAL}old-{nonce}"
    if final.exists():
        os.replace(final, old)  # never a moment without a complete tag under some name
    os.replace(partial, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def write_latest(root: Path, tag: str, nonce: str) -> None:
    """Point ``root/latest`` at ``tag`` atomically."""
    tmp = root / f"{LATEST}{PARTIAL}{nonce}"
    tmp.write_text(check_tag(tag))
    os.replace(tmp, root / LATEST)


def find_tag(root: str | os.PathLike[str], tag: str | None) -> Path | None:
    """The directory of ``tag`` (default: the one ``latest`` names), or None when there is nothing to load (no
    ``latest`` file, or no such directory), as DeepSpeed's ``load_checkpoint`` treats it; a version of ``tag``
    moved aside by an interrupted re-save (:func:`publish`) is found too. Hostile tags and
    ``latest`` contents raise :class:`CheckpointError`."""
    base = Path(root)
    if tag is None:
        tag = read_latest(base)
        if tag is None:
            return None
    path = tag_path(base, tag)
    if path.exists() or path.is_symlink():
        return check_inside(path, base)
    # A re-save of ``tag`` killed between moving the old version aside and publishing the new one: the old
    # version is complete under its aside name (see :func:`publish`).
    aside = sorted(
        (p for p in base.glob(f"{glob.escape(tag)}{PARTIAL}old-*") if is_ours(p)), key=lambda p: p.stat().st_mtime
    )
    return aside[-1] if aside else None

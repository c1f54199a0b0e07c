"""DeepSpeed's recovery script: ``save_checkpoint`` leaves an executable ``zero_to_fp32.py`` next to the tags.

A DeepSpeed user consolidates a ZeRO checkpoint with ``python SAVE_DIR/zero_to_fp32.py SAVE_DIR OUT_DIR``, the
script DeepSpeed copies into every save directory. hybridzero writes its own few lines under that name (they call
:func:`hybridzero.runtime.zero_to_fp32.main`, which reads only this project's verified checkpoint files), so the
same command works on our checkpoints. Written by rank 0 after the tag is published; a file of that name that is
not ours is left alone (a save never replaces what it did not write); a failure to write it or to make it
executable (a share without permissions, as Azure Files) is logged and the checkpoint stays valid.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

__all__ = ["RECOVERY_SCRIPT", "SCRIPT_MARK", "is_our_script", "make_executable", "write_recovery_script"]

RECOVERY_SCRIPT = "zero_to_fp32.py"
SCRIPT_MARK = "# written by hybridzero's save_checkpoint"
_TEXT = f'''#!/usr/bin/env python
{SCRIPT_MARK}
"""Consolidate the checkpoints in this directory into one fp32 state dict (DeepSpeed's zero_to_fp32.py usage):

    python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR [-t TAG] [--safe_serialization] [--max_shard_size 5GB]
        [--exclude_frozen_parameters]
"""

from hybridzero.runtime.zero_to_fp32 import main

if __name__ == "__main__":
    main()
'''


def is_our_script(path: Path) -> bool:
    """True if ``path`` is the recovery script a save wrote (a regular file of that name holding our mark): a
    checkpoint directory's own entry, like ``latest``."""
    if path.name != RECOVERY_SCRIPT or path.is_symlink() or not path.is_file():
        return False
    try:
        return SCRIPT_MARK in path.read_text(errors="replace")
    except OSError:
        return False


def make_executable(path: str | os.PathLike[str], log: logging.Logger) -> bool:
    """Add the execute bits to ``path`` (DeepSpeed's ``_change_recovery_script_permissions``); a file system that
    refuses (or a missing file) is logged at info level on ``log`` and reported ``False``, never raised."""
    try:
        mode = os.stat(path).st_mode
        os.chmod(path, mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    except OSError as exc:
        log.info("could not make the recovery script %s executable (%s); run it with `python %s`", path, exc, path)
        return False
    return True


def write_recovery_script(root: Path, log: logging.Logger) -> Path | None:
    """Write (or refresh) ``root/zero_to_fp32.py`` and make it executable; the path, or ``None`` when a foreign
    file holds the name or the write failed (logged)."""
    path = root / RECOVERY_SCRIPT
    try:
        if (path.exists() or path.is_symlink()) and not is_our_script(path):
            log.info("%s exists and was not written by hybridzero; left as it is", path)
            return None
        temporary = root / f".{RECOVERY_SCRIPT}.{os.getpid()}.tmp"
        temporary.write_text(_TEXT)
        os.replace(temporary, path)
    except OSError as exc:
        log.warning("could not write the recovery script %s: %s (the checkpoint is complete)", path, exc)
        return None
    make_executable(path, log)
    return path

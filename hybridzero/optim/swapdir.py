"""A run-private swap directory under ``nvme_path`` (ZeRO-Infinity's files), with crash safety.

Layout: ``<nvme_path>/hybridzero-swap/<uuid>-rank<r>/`` holding the swap files, next to its lock file
``<uuid>-rank<r>.lock`` (JSON: pid, host, rank), held with an exclusive ``flock`` from *before* the directory is
created until after it is removed -- so a directory is never seen without its owner's lock held.

Invariants:
* Private: the directory name carries a fresh uuid, so no run ever opens another run's files; swap files hold only
  state written by this process, never anything a restart reads back (checkpoints are written elsewhere).
* Crash safety: a directory whose lock file is missing or can be locked by us has no living owner (the kernel
  drops ``flock`` locks when a process dies): it is stale and is removed at start-up, never read. A directory with
  a held lock belongs to a live run and is left alone.
* Start-up checks: an ``nvme_path`` that cannot be created or written, or a disk without room for the bytes the
  run will swap, is a :class:`SwapSpaceError` naming the path and the numbers, before training starts; the bytes
  are reserved (``posix_fallocate``) so a step never meets a full disk.
* Cleaned on :meth:`SwapDir.close` (``engine.destroy()``), at garbage collection and at interpreter exit.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import uuid
import weakref
from pathlib import Path

__all__ = ["LOCK_SUFFIX", "SWAP_ROOT", "SwapDir", "SwapSpaceError", "check_space", "remove_stale"]

SWAP_ROOT = "hybridzero-swap"
LOCK_SUFFIX = ".lock"
_LOG = logging.getLogger("hybridzero")


class SwapSpaceError(RuntimeError):
    """``nvme_path`` is unusable for swapping: not writable, or without room for the run's bytes."""


def _lock(path: Path, blocking: bool) -> int | None:
    """An fd holding an exclusive flock on ``path`` (created if missing), or None if another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return None
        raise
    return fd


def remove_stale(root: Path) -> list[Path]:
    """Remove every swap directory under ``root`` whose owner is dead (its LOCK is free); returns them."""
    removed = []
    for entry in sorted(root.iterdir()) if root.is_dir() else []:
        if not entry.is_dir() or entry.is_symlink():
            continue
        lock = entry.with_name(entry.name + LOCK_SUFFIX)
        fd = _lock(lock, blocking=False)  # creates a missing lock file: then nobody owned the directory
        if fd is None:
            continue  # a live run owns it
        try:
            shutil.rmtree(entry, ignore_errors=True)
            lock.unlink(missing_ok=True)
            removed.append(entry)
        finally:
            os.close(fd)
    if removed:
        _LOG.warning(
            "removed %d stale swap director%s of killed runs under %s",
            len(removed),
            "y" if len(removed) == 1 else "ies",
            root,
        )
    return removed


def _cleanup(path: Path, fds: list[int]) -> None:
    """Remove the directory and its lock file, then release the lock (finalizer: no reference to the SwapDir)."""
    shutil.rmtree(path, ignore_errors=True)
    path.with_name(path.name + LOCK_SUFFIX).unlink(missing_ok=True)
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


class SwapDir:
    """This rank's private swap directory; :meth:`open_file` gives reserved, positional-I/O files inside it."""

    def __init__(self, nvme_path: str | os.PathLike[str], rank: int, key: str = "offload_optimizer") -> None:
        base = Path(nvme_path)
        self.key = key  # the config block naming nvme_path, for messages
        root = base / SWAP_ROOT
        try:
            root.mkdir(parents=True, exist_ok=True)
            remove_stale(root)
            self.path = root / f"{uuid.uuid4().hex}-rank{rank}"
            lock_fd = _lock(self.path.with_name(self.path.name + LOCK_SUFFIX), blocking=True)
            assert lock_fd is not None
            os.write(lock_fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "rank": rank}).encode())
            self.path.mkdir(mode=0o700)
        except OSError as exc:
            raise SwapSpaceError(
                f"{key}.nvme_path = {str(base)!r} is not a writable directory "
                f"({exc.strerror or exc}); give a directory this process can create files in"
            ) from exc
        self._fds: list[int] = [lock_fd]
        self._finalizer = weakref.finalize(self, _cleanup, self.path, self._fds)

    def open_file(self, name: str, reserve: int) -> int:
        """Create ``name`` in the directory with ``reserve`` bytes allocated on disk; returns its fd (owned here)."""
        if Path(name).name != name or name in ("", ".", ".."):
            raise ValueError(f"swap file name {name!r} must be a plain file name inside the swap directory")
        check_space(self, reserve, name)
        fd = os.open(self.path / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._fds.append(fd)
        try:
            if reserve > 0:
                os.posix_fallocate(fd, 0, reserve)
        except OSError as exc:
            self.close()
            raise SwapSpaceError(
                f"{self.key}.nvme_path: cannot reserve {reserve} bytes under "
                f"{self.path.parent.parent} ({exc.strerror or exc})"
            ) from exc
        return fd

    @property
    def closed(self) -> bool:
        """True once the directory is removed."""
        return not self._finalizer.alive

    def close(self) -> None:
        """Remove the directory and its files (idempotent)."""
        self._finalizer()


def check_space(swap_dir: SwapDir, needed: int, what: str) -> None:
    """Raise :class:`SwapSpaceError` (naming the path and both numbers) if the disk under ``swap_dir`` has fewer
    than ``needed`` free bytes: every byte the run will write to its swap files, checked once at start-up."""
    free = shutil.disk_usage(swap_dir.path).free
    if needed > free:
        swap_dir.close()
        raise SwapSpaceError(
            f"{swap_dir.key}.nvme_path: {needed} bytes are needed for {what} on this rank but only {free} are "
            f"free under {swap_dir.path.parent.parent}"
        )

"""Reward functions that start processes every way a user's checker can (module-level, so the worker and a forked
child both hold them), recording each started pid in a file so a test can assert that none outlives its call."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SPAWNED = 5  # processes each call starts (and records)


def _record(pidfile: Path, pid: int) -> None:
    with open(pidfile, "a") as f:
        f.write(f"{pid}\n")


def _forked(body: Callable[[], None]) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            body()
        finally:
            os._exit(0)
    return pid


def _daemon(pidfile: Path) -> None:
    """Double fork + setsid: the grandchild, in its own session, is orphaned at once."""
    read_fd, write_fd = os.pipe()

    def middle() -> None:
        os.setsid()
        grandchild = _forked(lambda: time.sleep(1000))
        os.write(write_fd, str(grandchild).encode())

    child = _forked(middle)
    os.waitpid(child, 0)
    os.close(write_fd)
    _record(pidfile, int(os.read(read_fd, 32)))
    os.close(read_fd)


def spawner(pidfile: Path, mode: str) -> Callable[..., list[float]]:
    """A function that forks a sleeping child, starts ``sleep`` in a new session, forks a child that calls setsid,
    daemonises one, and runs ``sh -c 'exec sleep 1000'`` (``subprocess.run`` in ``mode="hang"``, past any
    deadline), then returns, raises, hangs, exits or SIGKILLs itself per ``mode``."""

    def spawn(completions: list[str], **kwargs: Any) -> list[float]:
        _record(pidfile, _forked(lambda: time.sleep(1000)))
        _record(pidfile, subprocess.Popen(["sleep", "1000"], start_new_session=True).pid)
        _record(pidfile, _forked(lambda: (os.setsid(), time.sleep(1000)) and None))
        _daemon(pidfile)
        command = ["sh", "-c", f"echo $$ >> {pidfile}; exec sleep 1000"]
        if mode == "hang":
            subprocess.run(command, check=False)
        subprocess.Popen(command)
        while len(pidfile.read_text().split()) < SPAWNED:  # sh has written its pid
            time.sleep(0.01)
        if mode == "raise":
            raise RuntimeError("checker crashed after starting processes")
        if mode == "exit":
            os._exit(3)
        if mode == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        return [1.0] * len(completions)

    return spawn

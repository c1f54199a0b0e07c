"""Containing a reward process and everything it starts, so that all of it can be killed as a whole.

A reward function may start processes: a code-execution verifier runs ``subprocess.run([...])``, a checker forks,
a careless one daemonises (double fork + ``setsid``) or starts a new session. Killing only the process that called
the function would leave those alive, re-parented to init, one more per timed-out call. So every process that runs
reward code (the persistent worker, a child forked for one call, a child importing a reward module) is *contained*:

* **In the child** (:func:`enter_containment`, first thing after the fork): ``setsid()`` — its own session and
  process group, so a terminal's Ctrl-C or the trainer's group never reaches it and its plain children share its
  group — and ``PR_SET_CHILD_SUBREAPER`` (Linux): a descendant whose parent exits (a daemon's double fork) is
  re-parented to the contained process instead of init, so it stays in its process tree, findable.
* **In the parent** (:meth:`Containment.adopt`, before the child runs any reward code: the child waits for one byte
  on a pipe that the parent writes after adopting it): when a cgroup v2 hierarchy is mounted and the parent's own
  cgroup there is writable, a sub-cgroup ``hybridzero-reward-<parent>-<child>`` is created and the child moved in;
  everything it starts is born in it, whatever it does to its session or parent (only a process with write access
  to a common ancestor could leave). Otherwise (no cgroup v2, read-only, not Linux) the process tree and the
  session/group are all there is.
* **Killing** (:meth:`Containment.kill`): the root is SIGSTOPped (it forks nothing more), then, round after round
  until none is left alive, every process in the sub-cgroup, in the root's session or process group, or descending
  from the root (``/proc`` parent links: the subreaper keeps orphans there) is SIGKILLed — a killed process's
  children re-parent to the still-living (stopped) root, so the next round finds them; the root is killed last and
  reaped, and the sub-cgroup removed. Zombies count as gone (they hold no resources; the root's are re-parented to
  init when it dies and reaped there).

Invariants: a contained process never runs reward code outside its containment (it waits for the parent's byte);
after :meth:`Containment.kill` no live process of the containment is left. Limit: when the *trainer* is SIGKILLed,
nothing is left to run :meth:`kill`; the worker dies with it (``PR_SET_PDEATHSIG``) but what it started survives
(in its sub-cgroup when there is one, where ``cgroup.procs`` lists it).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from pathlib import Path

__all__ = ["Containment", "enter_containment", "live_pids", "wait_for_go"]

_PR_SET_CHILD_SUBREAPER = 36  # prctl option (linux/prctl.h)
_KILL_ROUNDS = 200  # each round kills what it finds; a fork bomb could need several
_ROUND_PAUSE_S = 0.002


def _prctl(option: int, value: int) -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(option, value)


def enter_containment() -> None:
    """In a freshly forked child: own session and process group, and subreaper of its orphaned descendants."""
    with contextlib.suppress(OSError):  # already a group leader (cannot happen right after fork)
        os.setsid()
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def wait_for_go(fd: int) -> None:
    """In the child: block until the parent has adopted it (one byte, or EOF when the parent is gone), then close."""
    try:
        os.read(fd, 1)
    finally:
        os.close(fd)


def _proc_table() -> dict[int, tuple[str, int, int, int]]:
    """``pid -> (state, ppid, pgid, sid)`` of every process (Linux ``/proc``; empty elsewhere)."""
    table: dict[int, tuple[str, int, int, int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return table
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        table[int(entry)] = (fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[3]))
    return table


def live_pids(pids: set[int] | list[int]) -> list[int]:
    """Those of ``pids`` that are still running (present and not a zombie)."""
    table = _proc_table()
    return sorted(p for p in pids if p in table and table[p][0] != "Z")


def _cgroup_base() -> Path | None:
    """This process's own cgroup v2 directory, when a cgroup2 hierarchy is mounted and the directory writable."""
    try:
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
        own = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    root = next((line.split()[4] for line in mounts if " - cgroup2 " in line), None)
    rel = next((line[3:] for line in own if line.startswith("0::")), None)
    if root is None or rel is None:
        return None
    base = Path(root) / rel.lstrip("/")
    return base if os.access(base, os.W_OK) and (base / "cgroup.procs").exists() else None


class Containment:
    """The parent's handle on one contained process (``pid``, a child of this process) and its sub-cgroup, if any."""

    def __init__(self, pid: int, cgroup: Path | None) -> None:
        self.pid, self.cgroup = pid, cgroup

    @classmethod
    def adopt(cls, pid: int, go_fd: int) -> Containment:
        """Move the freshly forked ``pid`` into a new sub-cgroup when one can be made, then let it run (write to and
        close ``go_fd``)."""
        cgroup: Path | None = None
        base = _cgroup_base()
        if base is not None:
            path = base / f"hybridzero-reward-{os.getpid()}-{pid}"
            try:
                path.mkdir()
                (path / "cgroup.procs").write_text(str(pid))
                cgroup = path
            except OSError:  # not allowed here after all: process tree and session only
                with contextlib.suppress(OSError):
                    path.rmdir()
        try:
            os.write(go_fd, b"g")
        except OSError:  # the child is already gone: kill() reaps it
            pass
        finally:
            os.close(go_fd)
        return cls(pid, cgroup)

    def members(self) -> set[int]:
        """Every live process of the containment but the root (see the module docstring)."""
        table = _proc_table()
        found = {p for p, (_, _, pgid, sid) in table.items() if self.pid in (pgid, sid)}
        if self.cgroup is not None:
            with contextlib.suppress(OSError, ValueError):
                found |= {int(p) for p in (self.cgroup / "cgroup.procs").read_text().split()}
        children: dict[int, list[int]] = {}
        for p, (_, ppid, _, _) in table.items():
            children.setdefault(ppid, []).append(p)
        stack = list(children.get(self.pid, []))
        while stack:
            p = stack.pop()
            found.add(p)
            stack.extend(children.get(p, []))
        found.discard(self.pid)
        return {p for p in found if p in table and table[p][0] != "Z"}

    def kill(self) -> int:
        """SIGKILL every process of the containment (root last), reap the root, remove the sub-cgroup; returns the
        root's wait status. Idempotent only in effect: call it once per containment."""
        _signal(self.pid, signal.SIGSTOP)
        for _ in range(_KILL_ROUNDS):
            victims = self.members()
            if not victims:
                break
            for p in victims:
                _signal(p, signal.SIGKILL)
            time.sleep(_ROUND_PAUSE_S)
        _signal(self.pid, signal.SIGKILL)
        try:
            status = os.waitpid(self.pid, 0)[1]
        except ChildProcessError:  # reaped elsewhere already
            status = 0
        self._remove_cgroup()
        return status

    def _remove_cgroup(self) -> None:
        if self.cgroup is None:
            return
        for _ in range(_KILL_ROUNDS):  # the last members leave the cgroup asynchronously after SIGKILL
            try:
                self.cgroup.rmdir()
                return
            except OSError:
                with contextlib.suppress(OSError, ValueError):
                    for p in (self.cgroup / "cgroup.procs").read_text().split():
                        _signal(int(p), signal.SIGKILL)
                time.sleep(_ROUND_PAUSE_S)


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)

"""A persistent pool of gloo worker processes for multi-rank tests.

Starting a process that imports torch and transformers takes seconds, so tests share one
:class:`WorldPool` per world size and send it module-level functions to run on every rank.

Invariants:

* Worker ``r`` has torchrun-like environment variables (``RANK=r``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``/``NODE_RANK``, ``MASTER_ADDR``,
  ``MASTER_PORT``, plus caller extras) set before it imports torch, runs with
  ``torch.set_num_threads(1)``, and holds an initialised default gloo process group for
  its whole life.
* Everything crossing the pipe is serialised with ``torch.save`` into bytes, so tensors
  travel by value (no shared-memory handles outlive a call).
* The parent never blocks without a deadline: every :meth:`WorldPool.run` ends within
  ``timeout`` (plus the grace period and kill time) with results, ``RemoteError`` or
  ``TimeoutError``.  When workers cannot be trusted any more (a rank died, stayed stuck in a
  collective, or timed out) all of them are killed and the pool is ``broken`` for good.
* This module imports torch lazily, so a spawned worker applies its environment first.
"""

from __future__ import annotations

import io
import os
import signal
import socket
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Mapping
from multiprocessing import get_context
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from types import TracebackType
from typing import Any, TypeVar

__all__ = ["RemoteError", "WorldPool"]

T = TypeVar("T")

_RESERVED_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_START_ATTEMPTS = 3
_CLOSE_TIMEOUT_S = 10.0


class RemoteError(RuntimeError):
    """A rank raised (or died) inside :meth:`WorldPool.run`.

    ``rank`` is the first rank seen failing, ``remote_traceback`` its traceback text and
    ``failures`` maps every failed rank to its text.  All of it is in ``str(error)``.
    """

    def __init__(self, rank: int, failures: Mapping[int, str], note: str = "") -> None:
        self.rank = rank
        self.failures = dict(failures)
        self.remote_traceback = self.failures[rank]
        parts = [f"rank {rank} failed:\n{self.remote_traceback}"]
        parts += [f"rank {r} also failed:\n{text}" for r, text in self.failures.items() if r != rank]
        if note:
            parts.append(note)
        super().__init__("\n".join(parts))


class _AddressInUse(RuntimeError):
    """Rank 0 could not listen on the chosen MASTER_PORT (another process took it)."""


def _dumps(obj: Any) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _loads(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker_env(rank: int, world_size: int, port: int, extra: Mapping[str, str]) -> dict[str, str]:
    """torchrun-like variables for ``rank``; ``extra`` may set LOCAL_WORLD_SIZE (nodes) and more."""
    local_world = int(extra.get("LOCAL_WORLD_SIZE", world_size))
    node = str(rank // local_world)
    env = {key: str(value) for key, value in extra.items()}
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank % local_world),
        LOCAL_WORLD_SIZE=str(local_world),
        GROUP_RANK=node,
        NODE_RANK=node,
        GROUP_WORLD_SIZE=str(world_size // local_world),
        ROLE_RANK=str(rank),
        ROLE_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    return env


def _exit_with_parent(parent_pid: int) -> None:
    """Worker watchdog: an orphaned worker (parent killed) exits instead of lingering."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(3)


def _worker_main(rank: int, env: dict[str, str], conn: Connection, pg_timeout_s: float, parent_pid: int) -> None:
    """Entry point of a spawned worker: set env, join the gloo group, serve calls until told to stop."""
    os.environ.update(env)
    os.dup2(2, 1)  # worker stdout goes to the parent's stderr
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers stop
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    try:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=timedelta(seconds=pg_timeout_s))
    except BaseException:
        conn.send_bytes(_dumps(("init_error", traceback.format_exc())))
        return
    conn.send_bytes(_dumps(("ready", os.getpid())))
    try:
        _serve(conn)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _spent_suffix() -> str:
    """``"_spent"`` once this worker's process group is gone (a failure tore it down): the pool cannot run more."""
    import torch.distributed as dist

    return "" if dist.is_initialized() else "_spent"


def _serve(conn: Connection) -> None:
    """Run ``("run", fn, args, kwargs)`` requests until ``("close",)`` or the parent goes away."""
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            request = _loads(data)
            if request[0] == "close":
                return
            _, fn, args, kwargs = request
            value = fn(*args, **kwargs)
            reply = _dumps(("ok" + _spent_suffix(), value))
        except BaseException:
            reply = _dumps(("error" + _spent_suffix(), traceback.format_exc()))
        try:
            conn.send_bytes(reply)
        except (BrokenPipeError, OSError):
            return


def _exit_text(process: BaseProcess) -> str:
    process.join(1.0)
    code = process.exitcode
    if code is not None and code < 0:
        try:
            return f"process exited by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"process exited by signal {-code}"
    return f"process exited with code {code}"


def _terminate(processes: list[BaseProcess], conns: list[Connection]) -> None:
    """Kill every still-running worker and close the parent's pipe ends (idempotent)."""
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join(5.0)
    for conn in conns:
        conn.close()


class WorldPool:
    """``world_size`` persistent gloo worker processes that run functions on every rank.

    Use as a context manager or call :meth:`close`.  Not thread-safe: one ``run`` at a time.
    """

    def __init__(
        self,
        world_size: int,
        *,
        env: Mapping[str, str] | None = None,
        start_timeout: float = 120.0,
        grace: float = 5.0,
        pg_timeout: float = 120.0,
    ) -> None:
        """Spawn the workers and wait until all joined the process group.

        ``grace`` is how long the other ranks get to finish after one rank failed;
        ``pg_timeout`` is the gloo collective timeout inside the workers.
        """
        extra = dict(env or {})
        bad = [key for key in _RESERVED_ENV if key in extra]
        local_world = int(extra.get("LOCAL_WORLD_SIZE", world_size))
        if world_size < 1 or bad or local_world < 1 or world_size % local_world:
            raise ValueError(
                f"bad pool: world_size={world_size}, LOCAL_WORLD_SIZE={local_world}, reserved env keys {bad}"
            )
        self._world_size = world_size
        self._grace = grace
        self._broken = False
        self._closed = False
        self._spent = False  # a worker's process group was torn down by a failure: no further runs
        self._processes: list[BaseProcess] = []
        self._conns: list[Connection] = []
        self._finalizer = weakref.finalize(self, _terminate, self._processes, self._conns)
        for attempt in range(_START_ATTEMPTS):
            try:
                self._start(extra, start_timeout, pg_timeout)
                return
            except BaseException as error:
                self._reset()
                if not isinstance(error, _AddressInUse) or attempt == _START_ATTEMPTS - 1:
                    self._closed = True
                    raise

    @property
    def world_size(self) -> int:
        """Number of ranks (worker processes)."""
        return self._world_size

    @property
    def broken(self) -> bool:
        """True once the pool cannot run anything: torn down after a failure, a worker died or lost its process
        group, or closed."""
        return self._broken or self._spent or self._closed or any(not p.is_alive() for p in self._processes)

    def _start(self, extra: dict[str, str], start_timeout: float, pg_timeout: float) -> None:
        ctx = get_context("spawn")
        port = _free_port()
        for rank in range(self._world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            process = ctx.Process(
                target=_worker_main,
                args=(rank, _worker_env(rank, self._world_size, port, extra), child_end, pg_timeout, os.getpid()),
                name=f"hybridzero-rank{rank}",
                daemon=True,
            )
            process.start()
            child_end.close()
            self._processes.append(process)
            self._conns.append(parent_end)
        _, _, failures, pending = self._collect(time.monotonic() + start_timeout, grace=0.0)
        if failures:
            rank, text = next(iter(failures.items()))
            error = _AddressInUse if "EADDRINUSE" in text or "address already in use" in text.lower() else RuntimeError
            raise error(f"rank {rank} failed to start:\n{text}")
        if pending:
            raise TimeoutError(f"ranks {pending} did not start within {start_timeout}s")

    def _reset(self) -> None:
        """Kill the current workers and forget them (the lists are shared with the finalizer)."""
        _terminate(self._processes, self._conns)
        self._processes.clear()
        self._conns.clear()

    def _receive(self, rank: int) -> tuple[str, Any]:
        """One message from ``rank``: ``(kind, value)``, or ``("died", text)`` if its pipe closed."""
        try:
            kind, value = _loads(self._conns[rank].recv_bytes())
        except (EOFError, OSError):
            return "died", _exit_text(self._processes[rank])
        if kind.endswith("_spent"):
            self._spent = True
            kind = kind.removesuffix("_spent")
        return ("failed", value) if kind in ("error", "init_error") else (kind, value)

    def _collect(self, deadline: float, grace: float) -> tuple[list[Any], set[int], dict[int, str], list[int]]:
        """Wait for one reply per rank until ``deadline``, or ``grace`` seconds after the first failure.

        Returns ``(values by rank, ranks that died, failure texts in arrival order, pending ranks)``.
        """
        values: list[Any] = [None] * self._world_size
        dead: set[int] = set()
        failures: dict[int, str] = {}
        pending = set(range(self._world_size))
        first_failure_at: float | None = None
        while pending:
            limit = deadline if first_failure_at is None else min(deadline, first_failure_at + grace)
            remaining = limit - time.monotonic()
            if remaining <= 0:
                break
            handles: list[Any] = [self._conns[r] for r in pending]
            handles += [self._processes[r].sentinel for r in pending]
            wait(handles, remaining)
            for rank in sorted(pending):
                if self._conns[rank].poll():
                    kind, value = self._receive(rank)
                elif not self._processes[rank].is_alive():
                    kind, value = "died", _exit_text(self._processes[rank])
                else:
                    continue
                pending.discard(rank)
                if kind == "died":
                    dead.add(rank)
                if kind in ("died", "failed"):
                    failures[rank] = value
                    first_failure_at = first_failure_at or time.monotonic()
                else:
                    values[rank] = value
        return values, dead, failures, sorted(pending)

    def run(self, fn: Callable[..., T], *args: Any, timeout: float = 300.0, **kwargs: Any) -> list[T]:
        """Call ``fn(*args, **kwargs)`` on every rank; return the results ordered by rank.

        ``fn`` must be a module-level function and its arguments and results picklable.
        Raises ``RemoteError`` if a rank raised or died, ``TimeoutError`` naming the unfinished
        ranks after ``timeout`` seconds, and ``RuntimeError`` if the pool is already broken.
        """
        if self.broken:
            raise RuntimeError(f"WorldPool(world_size={self._world_size}) is broken or closed")
        request = _dumps(("run", fn, args, kwargs))
        try:
            for conn in self._conns:
                conn.send_bytes(request)
            values, dead, failures, pending = self._collect(time.monotonic() + timeout, self._grace)
        except BaseException:
            self._teardown()
            raise
        if failures:
            note = ""
            if dead or pending:
                self._teardown()
                note = f"ranks {pending} still running after {self._grace}s grace" if pending else ""
                note += "; worker pool torn down" if note else "worker pool torn down"
            # a dead process is the likeliest root cause; otherwise blame the first failure seen
            raise RemoteError(min(dead) if dead else next(iter(failures)), failures, note)
        if pending:
            self._teardown()
            raise TimeoutError(
                f"ranks {pending} of {self._world_size} did not finish {getattr(fn, '__qualname__', fn)} "
                f"within {timeout}s; worker pool torn down"
            )
        return values

    def _teardown(self) -> None:
        self._broken = True
        self._finalizer()

    def close(self) -> None:
        """Ask workers to leave the process group and exit; kill those still alive after a short wait."""
        if self._closed:
            return
        self._closed = True
        if not self._broken:
            request = _dumps(("close",))
            for conn in self._conns:
                try:
                    conn.send_bytes(request)
                except OSError:
                    pass
            deadline = time.monotonic() + _CLOSE_TIMEOUT_S
            for process in self._processes:
                process.join(max(0.0, deadline - time.monotonic()))
        self._finalizer()

    def __enter__(self) -> WorldPool:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "broken" if self.broken else "ready"
        return f"WorldPool(world_size={self._world_size}, {state})"

"""Calling a reward function isolated from the trainer, with a deadline: a persistent worker, or a fork per call.

**Persistent worker** (:class:`RewardWorker`, the default path of ``reward_timeout > 0``). One child process per
:class:`~hybridzero.rlhf.rewards.sources.RewardSet` (so one per rank), *forked* — never spawned: the functions are not
pickled, closures and lambdas work, nothing is re-imported — at :meth:`RewardWorker.start` or lazily at the first
call, so it holds the functions and the process state (globals, ``os.environ``, open descriptors) as they are then.
Each call sends ``(function index, n, kwargs)`` as length-prefixed JSON over one pipe; the worker calls the
function, checks the result's shape (:func:`as_values`) and answers with length-prefixed JSON over another:
``{"values": [...]}`` or ``{"error", "samples"}`` — the same payloads, hence the same messages, as a forked
child's. The parent waits with ``select`` up to the deadline; when it passes, the worker is SIGKILLed and reaped and
the call fails with "did not return within --reward_timeout T s (killed)"; a worker that dies during a call
(``os._exit``, a crash, a signal) fails it with "died (exit status N | signal N) without returning". Either way the
next call forks a fresh worker. A function that raises or returns a bad result fails only its call; the worker
lives on. Why: the fork is paid once per worker instead of once per call (a fork of a process holding torch and a
model costs tens of ms; a worker round trip a fraction of one), while the deadline still ends a hang by killing a
process — a thread could not be stopped.

When to fork: the step-3 trainer starts the worker right after loading the functions, before any engine exists. A
worker keeps, copy-on-write, every page its parent rewrites after the fork, so one forked once the model and the
optimizer states are allocated would come to hold a second copy of all they overwrite (a replacement after a kill
or a death does: the rare path).

Invariants. A worker's functions run only in the worker: what a function keeps across calls (a cache, a counter)
persists *there*, as it would in-process or in TRL, and never reaches the trainer, nor does a global it mutates,
memory it leaks, or a crash. At most one call is in flight per worker. The worker runs none of the parent's
``atexit``/``finally`` code (it leaves with ``os._exit``), ignores SIGINT (Ctrl-C stops the trainer, which closes
it), and never outlives the parent: it exits on EOF of its request pipe and, checked every
``PARENT_POLL_S`` by a watchdog thread even while a function runs, when its parent process is gone.
:meth:`RewardWorker.close` (idempotent; also the context manager's exit) sends SIGTERM, then SIGKILL after a short
grace, and reaps it.

**Fork per call** (:func:`call_forked`): a child forked for one call, answering the same JSON over a pipe, then
``os._exit``-ing. The worker falls back to it for a call whose kwargs are not plain JSON (:func:`is_plain`: a
dataset column holding tuples, bytes, numpy values, dicts with non-string keys...), since JSON would not give the
function the same values it would get in-process; such a call keeps no state, as before the worker existed.

Both paths flush stdout/stderr before forking (the child inherits unflushed buffers: nothing prints twice). Kept
whole (just over 400 lines): both paths share the frame, payload and exit rules that make their messages identical.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import struct
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["PARENT_POLL_S", "RewardCallError", "RewardWorker", "as_values", "call_forked", "is_plain"]

RewardFunction = Callable[..., Sequence[float | None]]
PARENT_POLL_S = 1.0  # how often a worker checks that its parent is still alive
_READ_CHUNK = 1 << 16
_HEAD = struct.Struct("!Q")  # frame = 8-byte big-endian length, then that many bytes of UTF-8 JSON
_CLOSE_GRACE_S = 2.0
_PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h)
_SCALARS = frozenset({str, int, float, bool, type(None)})
_CONTAINERS = _SCALARS | {list, dict}


class RewardCallError(Exception):
    """One call failed; ``samples`` are the indices it concerns (``None``: the whole call)."""

    def __init__(self, message: str, samples: list[int] | None = None) -> None:
        super().__init__(message)
        self.samples = samples


def as_values(result: Any, n: int) -> list[float | None]:
    """``result`` as ``n`` floats or ``None``s (NaN/inf kept: the caller reports them by index)."""
    if isinstance(result, torch.Tensor):
        result = result.detach().cpu().tolist()
    if isinstance(result, (str, bytes)) or not hasattr(result, "__len__"):
        raise RewardCallError(f"returned a {type(result).__name__}; expected a list of {n} floats or None")
    if len(result) != n:
        raise RewardCallError(f"returned {len(result)} values for {n} completions")
    values: list[float | None] = []
    for i, v in enumerate(result):
        if v is None:
            values.append(None)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            values.append(float(v))
        else:
            raise RewardCallError(f"value {i} is a {type(v).__name__} ({v!r}); expected a float or None", [i])
    return values


def is_plain(obj: Any) -> bool:
    """True when JSON carries ``obj`` unchanged: exactly ``None``/``bool``/``int``/``float``/``str``, and lists
    and string-keyed dicts of those (a tuple would come back a list, a subclass as its base, an int key a str).
    Lists are checked a level at a time by their set of element types (C speed for the long lists of ids)."""
    kind = type(obj)
    if kind in _SCALARS:
        return True
    if kind is list:
        kinds = set(map(type, obj))
        return kinds <= _SCALARS or (kinds <= _CONTAINERS and all(is_plain(v) for v in obj))
    if kind is dict:
        return set(map(type, obj)) <= {str} and is_plain(list(obj.values()))
    return False


def _payload(fn: RewardFunction, kwargs: Mapping[str, Any], n: int) -> dict[str, Any]:
    """What a child sends back for one call: ``{"values"}`` or ``{"error", "samples"}`` (never raises)."""
    try:
        return {"values": as_values(fn(**kwargs), n)}
    except RewardCallError as exc:
        return {"error": str(exc), "samples": exc.samples}
    except BaseException as exc:  # noqa: BLE001 -- anything the function does is reported, never propagated
        return {"error": f"raised {type(exc).__name__}: {exc}"}


def _values_of(payload: Mapping[str, Any]) -> list[float | None]:
    if "error" in payload:
        raise RewardCallError(payload["error"], payload.get("samples"))
    return list(payload["values"])


def _exit_text(status: int) -> str:
    return f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit status {os.WEXITSTATUS(status)}"


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing to duplicate
            pass


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


# ---- fork per call ---------------------------------------------------------------------------------------------


def _child(fn: RewardFunction, kwargs: Mapping[str, Any], n: int, fd: int) -> None:
    """The forked child: call, convert, send JSON, exit without running the parent's atexit/finally code."""
    try:
        _write_all(fd, json.dumps(_payload(fn, kwargs, n)).encode())
        _flush()
        os.close(fd)  # EOF for the parent now, before this process's (slow) teardown
    finally:
        os._exit(0)


def _read_until(fd: int, pid: int, timeout: float) -> bytes:
    """Everything the child writes until EOF; SIGKILLs it and raises when ``timeout`` passes first."""
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    while True:
        ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0.0))
        if not ready:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise RewardCallError(f"did not return within --reward_timeout {timeout:g} s (killed)")
        chunk = os.read(fd, _READ_CHUNK)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def call_forked(fn: RewardFunction, kwargs: Mapping[str, Any], n: int, timeout: float) -> list[float | None]:
    """``fn(**kwargs)`` in a child forked for this call, killed after ``timeout`` s (module docstring)."""
    _flush()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        _child(fn, kwargs, n, write_fd)
    os.close(write_fd)
    try:
        data = _read_until(read_fd, pid, timeout)
    finally:
        os.close(read_fd)
    if not data:
        _, status = os.waitpid(pid, 0)
        raise RewardCallError(f"died ({_exit_text(status)}) without returning")
    # the answer is in: reap the exiting child off the critical path (its teardown takes longer than the fork)
    threading.Thread(target=os.waitpid, args=(pid, 0), name=f"reap-reward-{pid}", daemon=True).start()
    return _values_of(json.loads(data))


# ---- persistent worker -----------------------------------------------------------------------------------------


def _read_exact(fd: int, size: int) -> bytes | None:
    """Exactly ``size`` bytes from a blocking ``fd``; ``None`` on EOF."""
    buf = bytearray()
    while len(buf) < size:
        chunk = os.read(fd, min(size - len(buf), _READ_CHUNK))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _watch_parent(parent: int) -> None:
    """Worker thread: leave as soon as the parent is gone (we were re-parented), even mid-call."""
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent:
            os._exit(0)


def _serve(fns: Sequence[RewardFunction], req_fd: int, rep_fd: int) -> None:
    """The worker's loop: one request frame in, one reply frame out, until EOF on the request pipe."""
    while True:
        head = _read_exact(req_fd, _HEAD.size)
        if head is None:
            return
        body = _read_exact(req_fd, _HEAD.unpack(head)[0])
        if body is None:
            return
        request = json.loads(body)
        payload = _payload(fns[request["index"]], request["kwargs"], request["n"])
        data = json.dumps(payload).encode()
        _write_all(rep_fd, _HEAD.pack(len(data)) + data)
        _flush()  # the function's prints show up call by call


def _die_with_parent() -> None:
    """Linux: the kernel SIGKILLs this process when its parent dies (covers a function stuck in C code holding the
    GIL, where the watchdog thread cannot run); elsewhere the watchdog alone."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass


def _worker_main(fns: Sequence[RewardFunction], req_fd: int, rep_fd: int, parent: int) -> None:
    """Entry of the forked worker; never returns (``os._exit``: no parent atexit/finally code runs here)."""
    code = 0
    try:
        _die_with_parent()
        if os.getppid() != parent:  # the parent died before the request above took effect
            os._exit(0)
        torch.set_num_threads(1)  # a function using torch must not wait on the parent's OpenMP pool (fork-unsafe)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        threading.Thread(target=_watch_parent, args=(parent,), name="reward-worker-watchdog", daemon=True).start()
        _serve(fns, req_fd, rep_fd)
    except BaseException:  # noqa: BLE001 -- a broken pipe (parent gone) or a bug: leave quietly with status 1
        code = 1
    finally:
        _flush()
        os._exit(code)


class _Exchange:
    """The parent's side of one live worker: its pid, the request pipe's write end (non-blocking, so a send can
    honour the deadline) and the reply pipe's read end."""

    def __init__(self, pid: int, req_fd: int, rep_fd: int) -> None:
        self.pid, self.req_fd, self.rep_fd = pid, req_fd, rep_fd
        os.set_blocking(req_fd, False)

    def round_trip(self, request: bytes, deadline: float) -> bytes | None:
        """Send ``request``, return the reply frame's body; ``None`` when the worker is gone (broken pipe or EOF);
        raises ``TimeoutError`` when ``deadline`` passes first."""
        view = memoryview(request)
        while view:
            _, ready, _ = select.select([], [self.req_fd], [], max(deadline - time.monotonic(), 0.0))
            if not ready:
                raise TimeoutError
            try:
                view = view[os.write(self.req_fd, view) :]
            except BrokenPipeError:
                return None
        buf = bytearray()
        need = _HEAD.size
        while len(buf) < need:
            ready, _, _ = select.select([self.rep_fd], [], [], max(deadline - time.monotonic(), 0.0))
            if not ready:
                raise TimeoutError
            chunk = os.read(self.rep_fd, _READ_CHUNK)
            if not chunk:
                return None
            buf += chunk
            if need == _HEAD.size and len(buf) >= _HEAD.size:
                need += _HEAD.unpack_from(buf)[0]
        return bytes(buf[_HEAD.size : need])

    def stop(self, grace: float) -> int:
        """Close the pipes, end the worker (SIGTERM, then SIGKILL after ``grace`` s; at once when 0) and reap it;
        returns its wait status."""
        for fd in (self.req_fd, self.rep_fd):
            os.close(fd)
        if grace > 0:
            _signal(self.pid, signal.SIGTERM)
            end = time.monotonic() + grace
            while time.monotonic() < end:
                done, status = os.waitpid(self.pid, os.WNOHANG)
                if done:
                    return status
                time.sleep(0.01)
        _signal(self.pid, signal.SIGKILL)
        return os.waitpid(self.pid, 0)[1]


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:  # already reaped elsewhere: nothing to signal
        pass


class RewardWorker:
    """A persistent forked process calling ``fns[i](**kwargs)`` with a deadline (module docstring).

    Invariants: at most one live worker process at a time, forked at :meth:`start` or the first :meth:`call` after
    construction or after the previous one was killed, died or was closed; after :meth:`close` no child of this
    object is left (a later :meth:`call` would fork a fresh one); a call left by any exception but the function's
    own (Ctrl-C in the parent) ends the worker: a half-done exchange is never resumed, so a reply always answers
    its own request. Not thread-safe: one caller at a time."""

    def __init__(self, fns: Sequence[RewardFunction]) -> None:
        self.fns: tuple[RewardFunction, ...] = tuple(fns)
        self._live: _Exchange | None = None

    @property
    def pid(self) -> int | None:
        """The live worker's pid (``None``: none is running now)."""
        return self._live.pid if self._live is not None else None

    def index_of(self, fn: RewardFunction) -> int:
        """Position of ``fn`` (by identity) among this worker's functions; ``ValueError`` when it holds none."""
        for i, held in enumerate(self.fns):
            if held is fn:
                return i
        raise ValueError(f"reward function {fn!r} is not one of this worker's {len(self.fns)} functions")

    def start(self) -> None:
        """Fork the worker now unless one is live (otherwise the next :meth:`call` does)."""
        self._exchange()

    def _exchange(self) -> _Exchange:
        if self._live is not None:
            return self._live
        _flush()
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            os.close(req_w)
            os.close(rep_r)
            _worker_main(self.fns, req_r, rep_w, parent)
        os.close(req_r)
        os.close(rep_w)
        self._live = _Exchange(pid, req_w, rep_r)
        return self._live

    def call(self, index: int, kwargs: Mapping[str, Any], n: int, timeout: float) -> list[float | None]:
        """``fns[index](**kwargs)`` as ``n`` values, within ``timeout`` seconds; raises :class:`RewardCallError`
        with the forked child's messages. Kwargs that are not plain JSON (:func:`is_plain`) go to
        :func:`call_forked` instead."""
        try:
            plain = is_plain(kwargs)
        except RecursionError:  # nested deeper than JSON would take
            plain = False
        if not plain:
            return call_forked(self.fns[index], kwargs, n, timeout)
        data = json.dumps({"index": index, "n": n, "kwargs": kwargs}).encode()
        live = self._exchange()
        try:
            reply = live.round_trip(_HEAD.pack(len(data)) + data, time.monotonic() + timeout)
        except TimeoutError:
            self._end(grace=0.0)
            raise RewardCallError(f"did not return within --reward_timeout {timeout:g} s (killed)") from None
        except BaseException:  # e.g. Ctrl-C mid-call: a half-done exchange cannot be resumed, so end this worker
            self._end(grace=0.0)
            raise
        if reply is None:
            status = self._end(grace=0.0)
            raise RewardCallError(f"died ({_exit_text(status)}) without returning")
        return _values_of(json.loads(reply))

    def _end(self, grace: float) -> int:
        live, self._live = self._live, None
        return live.stop(grace) if live is not None else 0

    def close(self, grace: float = _CLOSE_GRACE_S) -> None:
        """End the live worker, if any (SIGTERM, SIGKILL after ``grace`` s, reaped). Idempotent."""
        self._end(grace)

    def __enter__(self) -> RewardWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

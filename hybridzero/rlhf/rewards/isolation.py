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
:meth:`RewardWorker.close` (idempotent; also the context manager's exit) kills it with everything it started
(:mod:`hybridzero.rlhf.rewards.containment`: own session, child subreaper, cgroup v2 sub-group when writable) and
reaps it; so do a timeout and a death.

**Fork per call** (:func:`call_forked`): a child forked for one call, answering the same JSON over a pipe, then
``os._exit``-ing. The worker falls back to it for a call whose kwargs are not plain JSON (:func:`is_plain`: a
dataset column holding tuples, bytes, numpy values, dicts with non-string keys...), since JSON would not give the
function the same values it would get in-process; such a call keeps no state, as before the worker existed.

Both paths flush stdout/stderr before forking (the child inherits unflushed buffers: nothing prints twice). Both
share the frame, payload and exit rules that make their messages identical: :mod:`hybridzero.rlhf.rewards.framing`.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from hybridzero.rlhf.rewards.containment import Containment, enter_containment, wait_for_go
from hybridzero.rlhf.rewards.framing import (
    _DEATH_POLL_S,
    _HEAD,
    RewardFunction,
    _exit_text,
    _flush,
    _payload,
    _read_exact,
    _read_frame,
    _send,
    _values_of,
    _write_all,
)
from hybridzero.rlhf.rewards.values import RewardCallError, as_values, is_plain, one_line

__all__ = ["PARENT_POLL_S", "RewardCallError", "RewardWorker", "as_values", "call_forked", "is_plain"]

Step = tuple[str, Callable[[], object]]  # a worker's start-up step: its label in messages, and what to run
PARENT_POLL_S = 1.0  # how often a worker checks that its parent is still alive
DEFAULT_START_S = 60.0  # start-up deadline when none is given
_PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h)


# ---- fork per call ---------------------------------------------------------------------------------------------


def _child(fn: RewardFunction, kwargs: Mapping[str, Any], n: int, fd: int, go: int) -> None:
    """The forked child: contained (own session, subreaper), waits to be adopted, calls, converts, sends one JSON
    frame, then waits to be killed (exiting by itself would hand what it started to init before the parent's kill
    reaches it), never running the parent's atexit/finally code."""
    parent = os.getppid()
    try:
        enter_containment()
        wait_for_go(go)
        data = json.dumps(_payload(fn, kwargs, n)).encode()
        _write_all(fd, _HEAD.pack(len(data)) + data)
        _flush()
        os.close(fd)
        while os.getppid() == parent:  # the parent kills this process and its tree once it has read the answer
            time.sleep(_DEATH_POLL_S)
    finally:
        os._exit(0)


def call_forked(fn: RewardFunction, kwargs: Mapping[str, Any], n: int, timeout: float) -> list[float | None]:
    """``fn(**kwargs)`` in a contained child forked for this call, killed with all it started after ``timeout`` s
    or once it has answered (module docstring)."""
    _flush()
    read_fd, write_fd = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        os.close(go_w)
        _child(fn, kwargs, n, write_fd, go_r)
    os.close(write_fd)
    os.close(go_r)
    box = Containment.adopt(pid, go_w)
    try:
        reply = _read_frame(read_fd, pid, time.monotonic() + timeout)
    except TimeoutError:
        box.kill()
        raise RewardCallError(f"did not return within --reward_timeout {timeout:g} s (killed)") from None
    finally:
        os.close(read_fd)
    status = box.kill()  # answered or dead: what it started goes with it
    if reply is None:
        raise RewardCallError(f"died ({_exit_text(status)}) without returning")
    return _values_of(json.loads(reply))


# ---- persistent worker -----------------------------------------------------------------------------------------


def _watch_parent(parent: int) -> None:
    """Worker thread: leave as soon as the parent is gone (we were re-parented), even mid-call."""
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent:
            os._exit(0)


def _prepare(steps: Sequence[Step], rep_fd: int) -> bool:
    """Run the start-up steps (importing reward modules), announcing each; ``False`` after reporting a failure."""
    for label, step in steps:
        _send(rep_fd, {"loading": label})
        try:
            step()
        except BaseException as exc:  # noqa: BLE001 -- reported to the parent, never propagated
            text = str(exc) if str(exc).startswith("--reward_funcs") else f"{label} raised {type(exc).__name__}: {exc}"
            _send(rep_fd, {"error": one_line(text)})
            return False
    _send(rep_fd, {"ready": True})
    return True


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
        _send(rep_fd, _payload(fns[request["index"]], request["kwargs"], request["n"]))


def _die_with_parent() -> None:
    """Linux: the kernel SIGKILLs this process when its parent dies (covers a function stuck in C code holding the
    GIL, where the watchdog thread cannot run); elsewhere the watchdog alone."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass


def _worker_main(worker: RewardWorker, fds: tuple[int, int, int], parent: int) -> None:
    """Entry of the forked worker; never returns (``os._exit``: no parent atexit/finally code runs here)."""
    req_fd, rep_fd, go_fd = fds
    code = 0
    try:
        _die_with_parent()
        if os.getppid() != parent:  # the parent died before the request above took effect
            os._exit(0)
        enter_containment()
        wait_for_go(go_fd)
        torch.set_num_threads(1)  # a function using torch must not wait on the parent's OpenMP pool (fork-unsafe)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        threading.Thread(target=_watch_parent, args=(parent,), name="reward-worker-watchdog", daemon=True).start()
        if _prepare(worker.steps, rep_fd):
            _serve(worker.fns, req_fd, rep_fd)
    except BaseException:  # noqa: BLE001 -- a broken pipe (parent gone) or a bug: leave quietly with status 1
        code = 1
    finally:
        _flush()
        os._exit(code)


class _Exchange:
    """The parent's side of one live worker: its containment (pid, sub-cgroup), the request pipe's write end
    (non-blocking, so a send can honour the deadline) and the reply pipe's read end."""

    def __init__(self, box: Containment, req_fd: int, rep_fd: int) -> None:
        self.box, self.req_fd, self.rep_fd = box, req_fd, rep_fd
        self.pid, self.status, self.pending = box.pid, 0, bytearray()
        os.set_blocking(req_fd, False)

    def ready(self, deadline: float, timeout: float) -> str | None:
        """Wait for the worker's start-up steps; ``None`` when ready, else the failure's one-line message."""
        label = "starting"
        while True:
            try:
                body = _read_frame(self.rep_fd, self.pid, deadline, self.pending)
            except TimeoutError:
                return f"{label} did not finish within --reward_timeout {timeout:g} s (killed)"
            if body is None:
                return f"{label}: the worker died ({_exit_text(self.stop())})"
            frame = json.loads(body)
            if "loading" in frame:
                label = frame["loading"]
            elif "error" in frame:
                return str(frame["error"])
            else:
                return None

    def round_trip(self, request: bytes, deadline: float) -> bytes | None:
        """Send ``request``, return the reply frame's body; ``None`` when the worker is gone (broken pipe, EOF or
        exited); raises ``TimeoutError`` when ``deadline`` passes first."""
        view = memoryview(request)
        while view:
            _, ready, _ = select.select([], [self.req_fd], [], max(deadline - time.monotonic(), 0.0))
            if not ready:
                raise TimeoutError
            try:
                view = view[os.write(self.req_fd, view) :]
            except BrokenPipeError:
                return None
        return _read_frame(self.rep_fd, self.pid, deadline, self.pending)

    def stop(self) -> int:
        """Close the pipes, kill the worker and everything it started (:meth:`Containment.kill`), reap it;
        returns its wait status. Idempotent."""
        if self.req_fd >= 0:
            # Kill before closing: the worker reads EOF on a closed request pipe and exits by itself, and a root
            # that exits before the kill stops it hands its orphans to init (outside the process tree).
            self.status = self.box.kill()
            for fd in (self.req_fd, self.rep_fd):
                os.close(fd)
            self.req_fd = self.rep_fd = -1
        return self.status


class RewardWorker:
    """A persistent forked, contained process calling ``fns[i](**kwargs)`` with a deadline (module docstring).

    ``steps`` (label, callable) run first in each fresh worker, under the deadline of the :meth:`start` or
    :meth:`call` that forks it (importing the reward modules: :class:`~hybridzero.rlhf.rewards.functions.SpecFunction`).

    Invariants: at most one live worker process at a time, forked at :meth:`start` or the first :meth:`call` after
    construction or after the previous one was killed, died or was closed; after :meth:`close` no process of this
    object is left, nor anything its functions started (a later :meth:`call` would fork a fresh one); a call left
    by any exception but the function's own (Ctrl-C in the parent) ends the worker: a half-done exchange is never
    resumed, so a reply always answers its own request. Not thread-safe: one caller at a time."""

    def __init__(self, fns: Sequence[RewardFunction], steps: Sequence[Step] = ()) -> None:
        self.fns: tuple[RewardFunction, ...] = tuple(fns)
        self.steps: tuple[Step, ...] = tuple(steps)
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

    def start(self, timeout: float = DEFAULT_START_S) -> None:
        """Fork the worker now unless one is live (otherwise the next :meth:`call` does) and wait up to ``timeout``
        s for its start-up steps; :class:`RewardCallError` (the worker killed) when one fails or hangs."""
        self._exchange(timeout)

    def _exchange(self, timeout: float) -> _Exchange:
        if self._live is not None:
            return self._live
        _flush()
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        go_r, go_w = os.pipe()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            for fd in (req_w, rep_r, go_w):
                os.close(fd)
            _worker_main(self, (req_r, rep_w, go_r), parent)
        for fd in (req_r, rep_w, go_r):
            os.close(fd)
        live = _Exchange(Containment.adopt(pid, go_w), req_w, rep_r)
        try:
            failure = live.ready(time.monotonic() + timeout, timeout)
        except BaseException:
            live.stop()
            raise
        if failure is not None:
            live.stop()
            raise RewardCallError(failure)
        self._live = live
        return live

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
        live = self._exchange(timeout)
        try:
            reply = live.round_trip(_HEAD.pack(len(data)) + data, time.monotonic() + timeout)
        except TimeoutError:
            self._end()
            raise RewardCallError(f"did not return within --reward_timeout {timeout:g} s (killed)") from None
        except BaseException:  # e.g. Ctrl-C mid-call: a half-done exchange cannot be resumed, so end this worker
            self._end()
            raise
        if reply is None:
            status = self._end()
            raise RewardCallError(f"died ({_exit_text(status)}) without returning")
        return _values_of(json.loads(reply))

    def _end(self) -> int:
        live, self._live = self._live, None
        return live.stop() if live is not None else 0

    def close(self) -> None:
        """Kill the live worker, if any, with everything it started, and reap it. Idempotent."""
        self._end()

    def __enter__(self) -> RewardWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""The wire and exit rules both isolation paths of :mod:`hybridzero.rlhf.rewards.isolation` share (the forked
child per call and the persistent worker), so that their messages are identical.

A frame is an 8-byte big-endian length, then that many bytes of UTF-8 JSON. A call's answer is ``{"values": [...]}``
or ``{"error", "samples"}`` (:func:`_payload` never raises: whatever the function does is reported). Invariants:
:func:`_read_frame` returns ``None`` on EOF or once the sender has exited (a descendant that kept the pipe open
cannot hide the death) and raises ``TimeoutError`` only when its deadline passes first; stdout/stderr are flushed
before each fork and after each sent frame (a forked child inherits unflushed buffers: nothing prints twice).
"""

from __future__ import annotations

import json
import os
import select
import struct
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hybridzero.rlhf.rewards.values import RewardCallError, as_values, one_line

RewardFunction = Callable[..., Sequence[float | None]]
_READ_CHUNK = 1 << 16
_HEAD = struct.Struct("!Q")  # frame = 8-byte big-endian length, then that many bytes of UTF-8 JSON
_DEATH_POLL_S = 0.1  # while waiting for a frame, how often to check that the sender is still alive


def _payload(fn: RewardFunction, kwargs: Mapping[str, Any], n: int) -> dict[str, Any]:
    """What a child sends back for one call: ``{"values"}`` or ``{"error", "samples"}`` (never raises)."""
    try:
        return {"values": as_values(fn(**kwargs), n)}
    except RewardCallError as exc:
        return {"error": str(exc), "samples": exc.samples}
    except BaseException as exc:  # noqa: BLE001 -- anything the function does is reported, never propagated
        return {"error": one_line(f"raised {type(exc).__name__}: {exc}")}


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


def _read_exact(fd: int, size: int) -> bytes | None:
    """Exactly ``size`` bytes from a blocking ``fd``; ``None`` on EOF."""
    buf = bytearray()
    while len(buf) < size:
        chunk = os.read(fd, min(size - len(buf), _READ_CHUNK))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _send(fd: int, payload: Mapping[str, Any]) -> None:
    data = json.dumps(payload).encode()
    _write_all(fd, _HEAD.pack(len(data)) + data)
    _flush()  # the function's prints show up call by call


def _exited(pid: int) -> bool:
    """Whether child ``pid`` has exited, without reaping it (its containment's kill reaps it)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _read_frame(fd: int, pid: int, deadline: float, buf: bytearray | None = None) -> bytes | None:
    """One length-prefixed frame from ``fd``; ``None`` on EOF or once ``pid`` has exited (a descendant that kept
    the pipe open cannot hide the death); ``TimeoutError`` when ``deadline`` passes first. ``buf`` holds bytes read
    past the frame (the start of the next one) between calls."""
    buf = bytearray() if buf is None else buf
    need = _HEAD.size + (_HEAD.unpack_from(buf)[0] if len(buf) >= _HEAD.size else 0)
    while len(buf) < need:
        left = deadline - time.monotonic()
        ready, _, _ = select.select([fd], [], [], min(max(left, 0.0), _DEATH_POLL_S))
        if not ready:
            if _exited(pid):
                return None
            if left <= 0:
                raise TimeoutError
            continue
        chunk = os.read(fd, _READ_CHUNK)
        if not chunk:
            return None
        buf += chunk
        if need == _HEAD.size and len(buf) >= _HEAD.size:
            need += _HEAD.unpack_from(buf)[0]
    frame = bytes(buf[_HEAD.size : need])
    del buf[:need]
    return frame

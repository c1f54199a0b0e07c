"""The persistent reward worker (hybridzero.rlhf.rewards.isolation): it answers as an in-process call does and keeps a
function's state between calls; a hang, a death or an interrupt in the parent ends it and the next call forks a fresh
one; columns JSON cannot carry fall back to a fork per call; ``close`` is idempotent; the reward set owns its worker;
a worker never outlives its parent. Shares the prompts, completions and ``_call`` of ``test_rlhf_rewards.py``.
"""

from __future__ import annotations

import math
import os
import select
import signal
import time
from collections.abc import Callable
from typing import Any, cast

import pytest
import torch

from hybridzero.rlhf.rewards.functions import RewardCallError
from hybridzero.rlhf.rewards.isolation import RewardWorker, is_plain
from hybridzero.rlhf.rewards.sources import RewardSet
from hybridzero.rlhf.settings import GRPOSettings
from tests.unit.test_rlhf_rewards import BAD, IDS, PROMPTS, TEXTS, _call, _counter
from tests.workers import rlvr_rewards


def _gone(pid: int) -> bool:
    """True when no process ``pid`` exists any more (killed and reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_the_worker_answers_as_in_process_and_keeps_state_there() -> None:
    fns = [rlvr_rewards.length_bonus, rlvr_rewards.matches_target, lambda **kw: torch.tensor([1.0, 2.0])]
    count = _counter()
    with RewardWorker([*fns, count, *(fn for fn, _, _ in BAD)]) as worker:
        for fn in fns:
            assert _call(fn, 30.0, worker, target=["21", None]) == _call(fn, 0.0, target=["21", None])
        pid = worker.pid
        assert pid is not None and pid != os.getpid()
        assert _call(count, 30.0, worker) == [1.0, 1.0]
        for fn, match, samples in BAD:  # the forked child's messages; the worker survives each
            with pytest.raises(RewardCallError, match=match) as info:
                _call(fn, 30.0, worker)
            assert info.value.samples == samples and worker.pid == pid
        assert _call(count, 30.0, worker) == [2.0, 2.0]  # the closure's state persists in the worker...
        assert _call(count, 0.0) == [1.0, 1.0]  # ...and never reached this process
        with pytest.raises(ValueError, match="not one of this worker's"):
            _call(rlvr_rewards.digit_share, 30.0, worker)
    assert _gone(pid) and worker.pid is None


def test_a_hang_or_a_death_ends_the_worker_and_the_next_call_forks_a_fresh_one() -> None:
    count = _counter()
    failures: list[tuple[Callable[..., Any], float, str]] = [
        (lambda **kw: time.sleep(60), 0.5, "did not return within --reward_timeout 0.5 s \\(killed\\)"),
        (lambda **kw: os._exit(3), 30.0, "died \\(exit status 3\\) without returning"),
        (lambda **kw: os.kill(os.getpid(), signal.SIGKILL), 30.0, "died \\(signal 9\\) without returning"),
    ]
    with RewardWorker([count, *(fn for fn, _, _ in failures)]) as worker:
        for fn, timeout, match in failures:
            assert _call(count, 30.0, worker) == [1.0, 1.0]  # a fresh worker: the count starts again
            pid = worker.pid
            assert pid is not None
            with pytest.raises(RewardCallError, match=match):
                _call(fn, timeout, worker)
            assert worker.pid is None and _gone(pid)  # killed (or dead) and reaped
        assert _call(count, 30.0, worker) == [1.0, 1.0] and worker.pid not in (None, pid)


class _Interrupted(Exception):
    pass


def _interrupt(signum: int, frame: object) -> None:
    raise _Interrupted


def test_a_call_interrupted_in_the_parent_ends_the_worker() -> None:
    count = _counter()
    previous = signal.signal(signal.SIGALRM, _interrupt)
    try:
        with RewardWorker([count, lambda **kw: time.sleep(60)]) as worker:
            assert _call(count, 30.0, worker) == [1.0, 1.0]
            pid = worker.pid
            assert pid is not None
            signal.setitimer(signal.ITIMER_REAL, 0.2)  # as Ctrl-C would: an exception while the parent waits
            with pytest.raises(_Interrupted):
                _call(worker.fns[1], 30.0, worker)
            assert worker.pid is None and _gone(pid)  # its late reply can never answer a later request
            assert _call(count, 30.0, worker) == [1.0, 1.0]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_columns_json_cannot_carry_fall_back_to_a_fork_per_call() -> None:
    assert is_plain({"a": [1, 2.5, None, True, "x", {"b": []}]})
    assert not any(is_plain(v) for v in ([(1, 2)], {1: "a"}, [b"x"], [math.pi, {"k": (1,)}], [torch.tensor(1)]))
    count = _counter()
    seen = lambda pair, **kw: [float(type(pair[0]) is tuple), float(sum(pair[1]))]  # noqa: E731
    with RewardWorker([count, seen]) as worker:
        assert _call(seen, 30.0, worker, pair=[(1, 2), (3, 4)]) == [1.0, 7.0]  # the tuples arrived as tuples
        assert worker.pid is None  # forked for that call alone: no worker started
        assert _call(count, 30.0, worker) == [1.0, 1.0]
        assert _call(count, 30.0, worker, pair=[(1, 2), (3, 4)]) == [1.0, 1.0]  # fork of this process: no state
        assert _call(count, 30.0, worker) == [2.0, 2.0]  # the worker's state is unaffected


def test_close_is_idempotent_and_leaves_no_child() -> None:
    worker = RewardWorker([rlvr_rewards.digit_share])
    worker.close()  # never started: nothing to do
    worker.start()
    pid = worker.pid
    assert pid is not None
    worker.start()  # already running: the same worker
    assert worker.pid == pid
    worker.close()
    worker.close()
    assert worker.pid is None and _gone(pid)
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # reaped: no zombie left either
    assert _call(rlvr_rewards.digit_share, 30.0, worker) == [2 / 3, 0.0]  # a later call forks a fresh one
    pid = worker.pid
    assert pid is not None
    worker.close()
    assert _gone(pid)


def test_the_reward_set_owns_its_worker() -> None:
    s = GRPOSettings(reward_timeout=30.0, reward_error_policy="skip")
    count = _counter()
    with RewardSet.build(s, [count]) as rewards:
        assert rewards.worker is not None and rewards.worker.pid is None  # forked lazily, or by start()
        scored = [rewards.score(cast(Any, None), PROMPTS, TEXTS, IDS, {}, torch.zeros(2)) for _ in range(2)]
        assert [sc.per_source[0].tolist() for sc in scored] == [[1.0, 1.0], [2.0, 2.0]]
        pid = rewards.worker.pid
        assert pid is not None
    assert _gone(pid) and rewards.worker.pid is None
    in_process = RewardSet.build(GRPOSettings(reward_timeout=0.0), [count])
    assert in_process.worker is None
    in_process.close()  # nothing to close


def _orphan_a_worker(hold_requests: bool) -> int:
    """Fork a child that starts a worker and exits without closing it (with ``hold_requests``, leaving a
    grandchild that holds the worker's request pipe open, so only the parent watchdog can end the worker). Returns
    the worker's pid, read from a pipe the child and the worker share, once it reads EOF: both have exited."""
    read_fd, write_fd = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover -- runs in the forked child
        try:
            os.close(read_fd)
            worker = RewardWorker([rlvr_rewards.digit_share])
            worker.start()
            holder = os.fork() if hold_requests else -1
            if holder == 0:
                os.close(write_fd)
                time.sleep(3600)  # holds the request pipe's write end; killed by the test
                os._exit(0)
            os.write(write_fd, f"{worker.pid} {holder}\n".encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    os.waitpid(child, 0)
    out, holder = b"", -1
    try:
        while True:
            ready, _, _ = select.select([read_fd], [], [], 60.0)
            assert ready, f"the orphaned worker is still alive ({out!r})"
            chunk = os.read(read_fd, 1024)
            if not chunk:
                return int(out.split()[0])
            out += chunk
            if out.endswith(b"\n"):
                holder = int(out.split()[1])
    finally:
        os.close(read_fd)
        if holder > 0:
            os.kill(holder, signal.SIGKILL)


def test_a_worker_never_outlives_its_parent() -> None:
    assert _orphan_a_worker(hold_requests=False) > 0  # EOF on its request pipe ended it
    assert _orphan_a_worker(hold_requests=True) > 0  # its watchdog saw the parent gone (the pipe stayed open)

"""Reward code cannot leave processes behind (issue 28): a function that forks a sleeping child, starts ``sleep`` in
a new session, forks a child that calls setsid, daemonises one (double fork + setsid) and runs
``subprocess.run(["sh", "-c", "exec sleep 1000"])`` — every started pid recorded in a file — has none of them
alive after a timeout, an error, its own death, or the normal end (the worker closed as at the end of a run); in
the persistent worker and forked per call, with the cgroup v2 sub-group when one can be made and with the process
tree and session alone."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybridzero.rlhf.rewards import containment as reward_containment
from hybridzero.rlhf.rewards.containment import live_pids
from hybridzero.rlhf.rewards.functions import RewardCallError, call_reward_function
from hybridzero.rlhf.rewards.isolation import RewardWorker
from tests.workers.leaky_rewards import SPAWNED, spawner

PROMPTS, TEXTS, IDS = ["1 ="], ["1"], [[3]]
HANG_S = 6.0  # deadline of the hanging calls (long enough for the five processes to start on a loaded machine)
CGROUP = reward_containment._cgroup_base() is not None


@pytest.fixture(params=["auto", "process_tree"])
def containment(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """``auto``: a cgroup v2 sub-group where this machine allows one; ``process_tree``: none (the fallback)."""
    if request.param == "process_tree":
        monkeypatch.setattr(reward_containment, "_cgroup_base", lambda: None)
    yield request.param


def _pids(path: Path) -> list[int]:
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _reap_leftovers(pids: list[int]) -> None:
    for pid in live_pids(pids):  # test hygiene only: a failing assertion must not leak sleeps either
        os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("mode", ["return", "raise", "hang"])
def test_nothing_survives_the_persistent_worker(tmp_path: Path, containment: str, mode: str) -> None:
    pidfile = tmp_path / "pids"
    fn = spawner(pidfile, mode)
    worker = RewardWorker([fn])
    timeout = HANG_S if mode == "hang" else 60.0
    try:
        if mode == "return":
            assert call_reward_function(fn, PROMPTS, TEXTS, IDS, {}, timeout=timeout, worker=worker) == [1.0]
        else:
            match = "did not return within" if mode == "hang" else "raised RuntimeError: checker crashed"
            with pytest.raises(RewardCallError, match=match):
                call_reward_function(fn, PROMPTS, TEXTS, IDS, {}, timeout=timeout, worker=worker)
        pids = _pids(pidfile)
        assert len(pids) == SPAWNED, pids
        if mode == "hang":  # killed at the deadline with all it started, before any close
            assert live_pids(pids) == [] and worker.pid is None
        else:  # the worker lives on (its processes may be the function's state) until the run ends
            assert live_pids(pids) == pids
            worker.close()
            assert live_pids(pids) == []
    finally:
        worker.close()
        _reap_leftovers(_pids(pidfile))


@pytest.mark.parametrize("mode", ["exit", "sigkill"])
def test_a_worker_that_dies_takes_what_it_started(tmp_path: Path, mode: str) -> None:
    """The worker's own death (``os._exit``, SIGKILL of itself) is reported as such, and with a cgroup v2 sub-group
    nothing it started survives; without one (documented limit) only what left its session and tree could."""
    pidfile = tmp_path / "pids"
    fn = spawner(pidfile, mode)
    worker = RewardWorker([fn])
    try:
        died = "exit status 3" if mode == "exit" else "signal 9"
        with pytest.raises(RewardCallError, match=f"died \\({died}\\) without returning"):
            call_reward_function(fn, PROMPTS, TEXTS, IDS, {}, timeout=60.0, worker=worker)
        pids = _pids(pidfile)
        assert len(pids) == SPAWNED
        attached = [pids[0], pids[4]]  # the plain fork and the sh: same session as the worker
        assert live_pids(pids if CGROUP else attached) == []
    finally:
        worker.close()
        _reap_leftovers(_pids(pidfile))


@pytest.mark.parametrize("mode", ["return", "raise", "hang"])
def test_nothing_survives_a_call_forked_for_itself(tmp_path: Path, containment: str, mode: str) -> None:
    """Columns JSON cannot carry (tuples) go to a child forked for the call: it and all it started end with the
    call, whichever way the call ends."""
    pidfile = tmp_path / "pids"
    fn = spawner(pidfile, mode)
    timeout = HANG_S if mode == "hang" else 60.0
    try:
        columns = {"pair": [(1, 2)]}
        if mode == "return":
            assert call_reward_function(fn, PROMPTS, TEXTS, IDS, columns, timeout=timeout) == [1.0]
        else:
            with pytest.raises(RewardCallError):
                call_reward_function(fn, PROMPTS, TEXTS, IDS, columns, timeout=timeout)
        pids = _pids(pidfile)
        assert len(pids) == SPAWNED and live_pids(pids) == []
    finally:
        _reap_leftovers(_pids(pidfile))


def test_the_cgroup_sub_group_is_removed(tmp_path: Path) -> None:
    """Where a cgroup v2 sub-group is made, the worker runs in it and it is gone after close."""
    worker = RewardWorker([spawner(tmp_path / "pids", "return")])
    worker.start(60.0)
    live = worker._live
    assert live is not None
    group = live.box.cgroup
    assert (group is not None) == CGROUP
    if group is not None:
        assert str(worker.pid) in (group / "cgroup.procs").read_text().split()
    worker.close()
    assert group is None or not group.exists()


class _LostPeerComm:
    """A comm whose collectives fail as gloo does when the peer process is gone."""

    rank, world_size = 0, 2

    def all_reduce(self, t: object, **kw: object) -> None:
        raise RuntimeError("[gloo/transport/tcp/pair.cc:598] Connection closed by peer [127.0.0.1]:41423\nmore")


def test_a_peer_lost_during_the_agreement_is_a_reward_error_naming_functions_and_rank() -> None:
    """A reward function that kills its trainer ends that rank; the survivor's agreement collective fails with a
    transport error, which becomes one line naming the functions just called and the lost rank."""
    from types import SimpleNamespace

    from hybridzero.rlhf.rewards.functions import RewardError
    from hybridzero.rlhf.rewards.sources import RewardSet

    engine = SimpleNamespace(comm=_LostPeerComm(), device="cpu")
    with pytest.raises(RewardError) as info:
        RewardSet._agree(engine, None, ["kills_trainer", "reward_model"])  # type: ignore[arg-type]
    message = str(info.value)
    assert message.startswith("rank 0: rank 1 left during the reward agreement") and "\n" not in message
    assert "['kills_trainer', 'reward_model']" in message and "Connection closed by peer" in message

"""Multi-process tests of WorldPool and the ``world`` fixture (real gloo process groups)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from tests.harness.spawn import RemoteError, WorldPool

_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK")


def _all_reduce_rank(offset: float) -> dict[str, object]:
    value = torch.tensor([dist.get_rank() + offset])
    dist.all_reduce(value)
    env = {key: os.environ[key] for key in _ENV_KEYS}
    return {"rank": dist.get_rank(), "sum": value, "env": env, "threads": torch.get_num_threads()}


def _raise_on(rank: int, message: str) -> int:
    if dist.get_rank() == rank:
        raise ValueError(message)
    return dist.get_rank()


def _raise_or_block(rank: int) -> None:
    if dist.get_rank() == rank:
        raise ValueError("rank gave up before the collective")
    dist.all_reduce(torch.ones(1))  # never completes: the raising rank does not join


def _die_on(rank: int) -> None:
    if dist.get_rank() == rank:
        os._exit(7)
    dist.all_reduce(torch.ones(1))


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def _big_tensor(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) + dist.get_rank()


@pytest.mark.parametrize(("world_size", "local_world_size"), [(1, None), (2, None), (3, None), (4, 2)], ids=str)
def test_all_reduce_results_ordered_by_rank(
    world: Callable[..., WorldPool], world_size: int, local_world_size: int | None
) -> None:
    env = None if local_world_size is None else {"LOCAL_WORLD_SIZE": str(local_world_size)}
    pool = world(world_size, env=env)
    results = pool.run(_all_reduce_rank, 0.5)
    local = local_world_size or world_size
    expected_sum = sum(range(world_size)) + 0.5 * world_size
    assert pool.world_size == world_size and len(results) == world_size
    for rank, result in enumerate(results):
        assert result["rank"] == rank
        assert result["sum"].item() == pytest.approx(expected_sum)
        assert result["threads"] == 1
        assert result["env"] == {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank % local),
            "LOCAL_WORLD_SIZE": str(local),
            "GROUP_RANK": str(rank // local),
            "NODE_RANK": str(rank // local),
        }
    assert world(world_size, env=env) is pool


def test_tensors_come_back_by_value(world: Callable[..., WorldPool]) -> None:
    pool = world(2)
    first, second = pool.run(_big_tensor, 1 << 20)
    assert torch.equal(second - first, torch.ones(1 << 20))
    assert pool.run(_big_tensor, n=3)[1].tolist() == [1.0, 2.0, 3.0]


def test_raising_rank_is_reported_and_pool_survives(world: Callable[..., WorldPool]) -> None:
    pool = world(2)
    with pytest.raises(RemoteError) as info:
        pool.run(_raise_on, 1, "boom-from-rank-1")
    assert info.value.rank == 1
    assert "rank 1" in str(info.value)
    assert "ValueError: boom-from-rank-1" in str(info.value)
    assert "_raise_on" in info.value.remote_traceback
    assert not pool.broken  # rank 0 returned normally, so the workers are still in step
    assert pool.run(_raise_on, -1, "unused") == [0, 1]


def test_rank_stuck_in_collective_does_not_hang(world: Callable[..., WorldPool]) -> None:
    pool = world(2)
    start = time.monotonic()
    with pytest.raises(RemoteError) as info:
        pool.run(_raise_or_block, 0, timeout=60)
    assert time.monotonic() - start < 30
    assert info.value.rank == 0 and "gave up before the collective" in str(info.value)
    assert "ranks [1] still running" in str(info.value)
    assert pool.broken
    with pytest.raises(RuntimeError, match="broken"):
        pool.run(_raise_on, -1, "unused")
    fresh = world(2)
    assert fresh is not pool and fresh.run(_raise_on, -1, "unused") == [0, 1]


def test_dead_rank_breaks_pool(world: Callable[..., WorldPool]) -> None:
    pool = world(2)
    with pytest.raises(RemoteError) as info:
        pool.run(_die_on, 1, timeout=60)
    assert info.value.rank == 1 and "exited with code 7" in str(info.value)
    assert pool.broken


def test_timeout_names_unfinished_ranks(world: Callable[..., WorldPool]) -> None:
    pool = world(1)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0\]"):
        pool.run(_sleep, 120.0, timeout=1.0)
    assert time.monotonic() - start < 15
    assert pool.broken


def test_reserved_env_is_rejected() -> None:
    with pytest.raises(ValueError):
        WorldPool(2, env={"RANK": "0"})
    with pytest.raises(ValueError):
        WorldPool(4, env={"LOCAL_WORLD_SIZE": "3"})

"""Shared pytest fixtures.

``world(n, env=None)`` returns a session-cached :class:`~tests.harness.spawn.WorldPool`
of ``n`` gloo ranks; a broken pool is replaced by a fresh one, and the least recently used
pools are closed when more than ``_MAX_CACHED_WORKERS`` worker processes would stay alive.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest

from tests.harness.spawn import WorldPool

# bench/ and examples/ are scripts, not packages: their modules (bench_model, train_demo, gguf_import) import by
# name, here and in spawned workers (multiprocessing's spawn hands sys.path to the children).
_REPO = Path(__file__).resolve().parents[1]
for _folder in ("bench", "examples"):
    if str(_REPO / _folder) not in sys.path:
        sys.path.append(str(_REPO / _folder))

_MAX_CACHED_WORKERS = 12

WorldFactory = Callable[..., WorldPool]
_PoolKey = tuple[int, tuple[tuple[str, str], ...]]


class _PoolCache:
    """Pools by ``(world_size, sorted env items)``, most recently used last."""

    def __init__(self, max_workers: int) -> None:
        self._max_workers = max_workers
        self._pools: OrderedDict[_PoolKey, WorldPool] = OrderedDict()

    def get(self, world_size: int, env: Mapping[str, str] | None = None) -> WorldPool:
        """A healthy pool for ``world_size`` ranks with ``env`` extras (started if needed)."""
        key: _PoolKey = (world_size, tuple(sorted((env or {}).items())))
        pool = self._pools.pop(key, None)
        if pool is not None and pool.broken:
            pool.close()
            pool = None
        if pool is None:
            self._evict(room_for=world_size)
            pool = WorldPool(world_size, env=env)
        self._pools[key] = pool
        return pool

    def _evict(self, room_for: int) -> None:
        while self._pools and sum(p.world_size for p in self._pools.values()) + room_for > self._max_workers:
            _, oldest = self._pools.popitem(last=False)
            oldest.close()

    def close(self) -> None:
        """Close every cached pool."""
        while self._pools:
            _, pool = self._pools.popitem()
            pool.close()


@pytest.fixture(scope="session")
def world() -> Iterator[WorldFactory]:
    """Factory ``world(world_size, env=None) -> WorldPool``; pools live for the whole session."""
    cache = _PoolCache(_MAX_CACHED_WORKERS)
    try:
        yield cache.get
    finally:
        cache.close()

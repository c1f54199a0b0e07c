"""Pure topology math: nodes and hpZ (hierarchical partitioning) groups.

Ranks are laid out the way torchrun assigns them: node ``n`` holds the consecutive global ranks
``[n * L, (n + 1) * L)`` with ``L = LOCAL_WORLD_SIZE``. An hpZ group of size ``h`` is a block of ``h`` consecutive
ranks inside one node, so a secondary-shard gather never leaves the node.
"""

from __future__ import annotations

import os
from collections.abc import Mapping


def local_world_size(env: Mapping[str, str] | None = None, world_size: int = 1) -> int:
    """Ranks per node from torchrun's environment (``LOCAL_WORLD_SIZE``), else the whole world is one node."""
    env = os.environ if env is None else env
    return int(env.get("LOCAL_WORLD_SIZE", world_size))


def node_groups(world_size: int, local: int) -> list[list[int]]:
    """Global ranks of each node."""
    if local < 1 or world_size % local:
        raise ValueError(f"LOCAL_WORLD_SIZE={local} does not divide the world size {world_size}")
    return [list(range(n * local, (n + 1) * local)) for n in range(world_size // local)]


def hpz_groups(world_size: int, hpz: int, local: int) -> list[list[int]]:
    """Blocks of ``hpz`` consecutive ranks, each inside one node; errors name both sizes when impossible."""
    if hpz < 1 or world_size % hpz:
        raise ValueError(f"zero_optimization.zero_hpz_partition_size={hpz} must divide the world size {world_size}")
    if local % hpz:
        raise ValueError(
            f"zero_optimization.zero_hpz_partition_size={hpz} must divide the node size "
            f"(LOCAL_WORLD_SIZE={local}): a secondary shard may not span nodes"
        )
    return [list(range(start, start + hpz)) for start in range(0, world_size, hpz)]

"""``GatheredParameters``: full parameters inside a ``with`` block, with an optional modifier rank.

Semantics (DeepSpeed's, with the engine named explicitly because parameters carry no hidden state here):

* On entry every group holding one of ``params`` is gathered and pinned: forwards inside the block do not release
  it. Always-whole groups (persistent, stages 0–2) are already full.
* On exit without a modifier the groups are unpinned and released; changes made inside are discarded.
* On exit with ``modifier_rank=r`` each affected group's full buffer is broadcast from rank ``r`` and the values of
  exactly the named parameters are written into the master through :meth:`ShardedGroup.absorb_full`, the one
  write path (so every derived copy — compute shard, whole buffers, any cache of the shard — is refreshed).

Every rank must enter and leave the block together (the gathers and broadcasts are collectives).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

from hybridzero.zero.groups import GroupState

if TYPE_CHECKING:
    from hybridzero.runtime.engine import Engine


@contextmanager
def GatheredParameters(params: nn.Parameter | Iterable[nn.Parameter], modifier_rank: int | None = None, *,
                       engine: Engine, enabled: bool = True) -> Iterator[None]:
    """Full values of ``params`` (parameters of ``engine.module``) inside the block; see the module docstring."""
    plist = [params] if isinstance(params, torch.Tensor) else list(params)
    if not enabled or not plist:
        yield
        return
    wanted = {id(p) for p in plist}
    touched = [(g, [s for s in g.slots if id(s.param) in wanted]) for g in engine.groups]
    touched = [(g, slots) for g, slots in touched if slots]
    found = {id(s.param) for _, slots in touched for s in slots}
    missing = [i for i, p in enumerate(plist) if id(p) not in found]
    if missing:
        raise ValueError(f"GatheredParameters: parameters at positions {missing} do not belong to this engine's module")
    if modifier_rank is not None and not 0 <= modifier_rank < engine.comm.world_size:
        raise ValueError(f"modifier_rank={modifier_rank} is not a rank of a world of size {engine.comm.world_size}")
    was_gathered = {g.index for g, _ in touched if g.state is GroupState.GATHERED}
    for group, _ in touched:
        group.pins += 1  # all pinned before any gather, so the finally below never unpins what it did not pin
    try:
        for group, _ in touched:
            group.wait("gathered_parameters")
        yield
    finally:
        with torch.no_grad():
            for group, slots in touched:
                group.pins -= 1
                if modifier_rank is not None:
                    assert group.full is not None
                    engine.comm.broadcast(group.full, modifier_rank, phase="gathered_parameters")
                    group.absorb_full(slots)
                else:
                    group.drop_secondary()  # a forward inside the block may have cached discarded edits
                if group.index not in was_gathered:
                    engine.coordinator.release(group)

"""Coalesced gathers: several groups' all-gathers issued as one collective.

``start_gathers(groups, phase, comm)`` puts every eligible group (SHARDED, plain ZeRO-3 primary gather: no valid
hpZ secondary, no qwZ) into one all-gather of the concatenated shards::

    send = [A_r | B_r | ...]                      (this rank's shards, one copy)
    recv = [A_0 B_0 ... | A_1 B_1 ... | ...]      (world x sum of shard sizes)

(each master shard is cast straight into ``send``: the cast is the packing copy) and gives each group a completion
step that copies its rank-major slices out of ``recv`` into its own full buffer
(``A_full = [A_0 | A_1 | ...]``), so a group's buffer, views and release are exactly those of a single gather: the
values are bit-identical, only the number of collectives changes. All groups hold the same
:class:`~hybridzero.comm.collectives.PendingCollective` (its ``wait`` is idempotent), so each group still owns a
pending gather until it waits or releases; ``recv`` lives until the last group has copied its part.
Ineligible groups, a batch of one, or any batch at world size 1 (where a gather is one local copy and coalescing
would only add the packing and unpacking copies) gather on their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from hybridzero.zero.groups import GroupState, ShardedGroup

if TYPE_CHECKING:
    from hybridzero.comm.collectives import Comm

__all__ = ["start_gathers"]


def _eligible(group: ShardedGroup) -> bool:
    return (
        group.state is GroupState.SHARDED
        and not group.always_full
        and not group.secondary_valid()
        and group.quantize_block is None
    )


def start_gathers(groups: Sequence[ShardedGroup], phase: str, comm: Comm) -> None:
    """Launch the gathers of ``groups``: the eligible ones coalesced into one collective (see module docstring)."""
    unique = list({id(g): g for g in groups}.values())
    batch = [g for g in unique if _eligible(g)]
    dtypes = {g.compute_dtype for g in batch}
    if len(batch) < 2 or len(dtypes) != 1 or comm.world_size == 1:  # one rank: no latency to save, only copies
        for g in unique:
            g.start_gather(phase)
        return
    sizes = [g.layout.shard_numel for g in batch]
    total = sum(sizes)
    with comm.ledger.timer.region("copy.cast"):  # cast fused with the packing: one pass per shard
        send = torch.empty(total, dtype=batch[0].compute_dtype, device=batch[0].device)
        offset = 0
        for group, size in zip(batch, sizes):
            kept = group.kept_shard()  # ZeRO-Infinity: the master is in a file, the compute shard is kept
            # = compute_shard(), written in place (same rounding)
            send[offset : offset + size].copy_(kept if kept is not None else group.master)
            offset += size
    recv = torch.empty(comm.world_size * total, dtype=send.dtype, device=send.device)
    handle = comm.all_gather(recv, send, phase=phase, async_op=True)
    offset = 0
    for group, size in zip(batch, sizes):
        group.join_coalesced(handle, send, recv, offset, total)
        offset += size
    for g in unique:
        if not any(g is b for b in batch):
            g.start_gather(phase)

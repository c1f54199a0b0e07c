"""qgZ: gradient reduce-scatter with block-quantized payloads through a hierarchical all-to-all.

Rank ``g = n * L + j`` (node ``n`` of ``N``, local index ``j`` of ``L``). The rank-major flat gradient ``[W, C]`` of a
bucket is reduced in two stages, each an all-to-all of quantized slices followed by a dequantize-and-sum in a
fixed order (so the result is deterministic):

1. inside the node: peer ``j'`` receives, from every node-mate, the columns destined for ranks ``(m, j')`` of every
   node ``m``, and sums them in local-rank order: node partial sums;
2. across nodes, among ranks of equal local index: rank ``(m, j)`` receives every node's partial sum of its own
   columns and sums them in node order.

Cross-node traffic is one quantized partial sum per node instead of every rank's full-precision slice: with int8 it
is about ``1 / (4 L)`` of a flat fp32 reduce-scatter's cross-node bytes. The result is the plain sum (the caller
divides by the world size once).
"""

from __future__ import annotations

import torch

from hybridzero.comm.collectives import Comm
from hybridzero.comm.quantize import (
    dequantize_blockwise,
    from_wire,
    quantize_blockwise,
    to_wire,
)
from hybridzero.zero.ordered import ordered_sum


def _exchange(comm: Comm, rows: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """All-to-all of ``rows`` ``[P, n]`` (row ``p`` goes to peer ``p``) as quantized wires; returns ``[P, n]`` fp32
    of what every peer sent this rank, in peer order."""
    peers, n = rows.shape
    wires = [to_wire(quantize_blockwise(rows[p], bits=bits, block=block)) for p in range(peers)]
    send = torch.cat(wires)
    recv = torch.empty_like(send)
    comm.exchange_for_reduce(recv, send, phase="backward")
    size = wires[0].numel()
    return torch.stack(
        [dequantize_blockwise(from_wire(recv[p * size : (p + 1) * size], n, bits, block)) for p in range(peers)]
    )


class HierarchicalQuantizedReduce:
    """Two-stage quantized reduce-scatter over a node group (``intra``) and a cross-node group (``cross``)."""

    def __init__(self, intra: Comm, cross: Comm, bits: int, block: int) -> None:
        if bits not in (4, 8):
            raise ValueError(f"zero_optimization.zero_quantized_gradients_bits={bits} must be 8 or 4")
        self.intra, self.cross, self.bits, self.block = intra, cross, bits, block

    def reduce(self, inp: torch.Tensor, cols: int) -> torch.Tensor:
        """Sum over ranks of this rank's ``cols`` columns of the rank-major ``inp`` ``[W * cols]`` (fp32)."""
        local, nodes = self.intra.world_size, self.cross.world_size
        grid = inp.float().view(nodes, local, cols)  # [m, j', c]: the columns rank (m, j') owns
        stage1 = grid.permute(1, 0, 2).reshape(local, nodes * cols)  # row j': everything destined for local j'
        partial = ordered_sum(_exchange(self.intra, stage1, self.bits, self.block)).view(nodes, cols)
        if nodes == 1:
            return partial[0]
        return ordered_sum(_exchange(self.cross, partial, self.bits, self.block))

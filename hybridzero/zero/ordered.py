"""The one summation order of every gradient reduction: rows added strictly in rank order, in fp32."""

from __future__ import annotations

import torch


def ordered_sum(rows: torch.Tensor) -> torch.Tensor:
    """fp32 sum of the rows of ``rows`` ``[P, n]`` strictly in row order: ``((r0 + r1) + r2) + …``.

    Consumes ``rows`` (a received temporary): an fp32 first row is accumulated in place. A single process that adds
    per-rank gradients in this order reproduces the result bit for bit."""
    total = rows[0].float()
    for r in range(1, rows.shape[0]):
        total.add_(rows[r].float())
    return total

"""A cheap, exact-enough fingerprint of a tensor's contents, used to detect edits made inside a
``GatheredParameters`` block without a ``modifier_rank`` (engine-owned and ``zero.Init``-owned parameters alike)."""

from __future__ import annotations

import torch

__all__ = ["content_checksum"]

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 16


def content_checksum(t: torch.Tensor) -> torch.Tensor:
    """Two int64 sums over the raw bits of ``t`` (plain and position-weighted, wrapping on overflow): any change of
    one element, a swap or a sign flip changes the result. Pure; never a whole int64 copy of ``t``."""
    bits = t.detach().reshape(-1).view(_BITS[t.element_size()])
    out = torch.zeros(2, dtype=torch.int64, device=t.device)
    for start in range(0, bits.numel(), _CHUNK):
        chunk = bits[start : start + _CHUNK].to(torch.int64)
        weights = torch.arange(start + 1, start + 1 + chunk.numel(), dtype=torch.int64, device=t.device)
        out[0] += chunk.sum()
        out[1] += (chunk * weights).sum()
    return out

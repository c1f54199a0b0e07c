"""Pure partition math for flat, padded, evenly sharded buffers.

A gather group's parameters are laid one after another in one flat buffer, each starting at a multiple of
``ALIGN`` elements; the buffer is padded at its end to a multiple of ``PARTITION_ALIGN`` times the world size (of
the world size alone over one rank); rank ``r`` owns the contiguous slice ``[r * S, (r + 1) * S)`` with
``S = padded / W``, so every rank's partition starts at a multiple of ``PARTITION_ALIGN`` elements (4-byte aligned in
16-bit: DeepSpeed's ``nccl_start_alignment_factor``, which its all-gather send buffers need).

Why aligned offsets: a parameter bound as a view of the gathered buffer must sit at the same alignment as a freshly
allocated tensor, or some CPU kernels (e.g. the matrix-vector path of ``F.linear`` with one output feature) round
differently and a sharded run stops being bit-for-bit equal to the unsharded model; aligned views also keep GPU
loads vectorized.

Invariants (unit-tested):
* ``padded_numel % (a * world_size) == 0`` and ``numel <= padded_numel < numel + a * world_size`` (for
  ``numel > 0``), with ``a = PARTITION_ALIGN`` for ``world_size > 1`` and ``a = 1`` for one rank.
* Every parameter's offset is a multiple of ``ALIGN``; gaps between parameters and the tail are padding, which is
  zero in every buffer (master, gradients) and never read as a parameter.
* Every element of ``[0, padded_numel)`` belongs to exactly one shard.
* Shapes always come from :class:`ParamSpec` metadata, never from the size of a local shard.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

ALIGN = 16  # elements: 64 bytes in fp32, 32 in bf16/fp16
PARTITION_ALIGN = 2  # elements: every rank's partition starts 4-byte aligned in 16-bit (DeepSpeed's factor)


@dataclass(frozen=True)
class ParamSpec:
    """Where one parameter lives in its group's flat buffer."""

    name: str
    shape: torch.Size
    offset: int
    numel: int

    @property
    def end(self) -> int:
        """One past the parameter's last element in the flat buffer."""
        return self.offset + self.numel


def padded_numel(numel: int, world_size: int, align: int = 1) -> int:
    """Smallest multiple of ``align * world_size`` that holds ``numel`` elements (at least one multiple): each of
    the ``world_size`` equal partitions then starts at a multiple of ``align`` elements."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    unit = align * world_size
    return max(1, -(-numel // unit)) * unit


def intersect(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    """The overlap of half-open ranges ``a`` and ``b``, or ``None`` when empty."""
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


@dataclass(frozen=True)
class FlatLayout:
    """Layout of one flat buffer sharded over ``world_size`` ranks."""

    specs: tuple[ParamSpec, ...]
    numel: int
    padded_numel: int
    world_size: int

    @property
    def shard_numel(self) -> int:
        """Elements each rank owns (padding included)."""
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Half-open flat range that ``rank`` owns."""
        s = self.shard_numel
        return rank * s, (rank + 1) * s

    def local_ranges(self, rank: int, flat_range: tuple[int, int]) -> tuple[int, int] | None:
        """The part of ``flat_range`` that ``rank`` owns, in shard-local coordinates (or ``None``)."""
        lo, hi = self.shard_range(rank)
        hit = intersect((lo, hi), flat_range)
        return None if hit is None else (hit[0] - lo, hit[1] - lo)


def build_layout(names: Sequence[str], shapes: Sequence[torch.Size], world_size: int) -> FlatLayout:
    """Lay out parameters of ``shapes`` in the given order at ``ALIGN``-aligned offsets, padded for ``world_size``
    partitions that each start at a multiple of ``PARTITION_ALIGN`` elements."""
    if len(names) != len(shapes):
        raise ValueError("names and shapes must have the same length")
    specs: list[ParamSpec] = []
    offset = 0
    for name, shape in zip(names, shapes):
        n = int(torch.Size(shape).numel())
        offset = -(-offset // ALIGN) * ALIGN
        specs.append(ParamSpec(name=name, shape=torch.Size(shape), offset=offset, numel=n))
        offset += n
    return FlatLayout(
        specs=tuple(specs),
        numel=offset,
        padded_numel=padded_numel(offset, world_size, PARTITION_ALIGN if world_size > 1 else 1),
        world_size=world_size,
    )

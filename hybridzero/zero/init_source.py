"""Hand a ``zero.Init``-built model to the engine without ever making it whole: one group's shard at a time.

The engine lays a group's parameters out in one flat buffer and each rank needs only its range of it; ``zero.Init``
holds every parameter as per-parameter slices. :func:`stage_group` walks the group's parameters in layout order
(the same on every rank), all-gathers one parameter at a time from its store, keeps only the elements this rank's
range covers and drops the full value, and returns them as a :class:`StagedSource` (a
:class:`~hybridzero.tensor_source.TensorSource`) that the group reads exactly as it reads a checkpoint.

Invariants: at most one parameter is whole at a time (plus this rank's staged pieces, the size of its shard);
parameters nobody partitioned are broadcast from rank 0 like eager-built ones; afterwards the stores forget the
parameters (:func:`release_from_init`), so the engine is their only owner.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from hybridzero.comm.collectives import Comm
from hybridzero.tensor_source import check_range
from hybridzero.zero.group_types import ShardMode
from hybridzero.zero.init_store import InitStore
from hybridzero.zero.layout import build_layout, intersect
from hybridzero.zero.registry import REGISTRY, full_shape

__all__ = ["StagedSource", "init_store_of", "init_stores", "release_from_init", "stage_group"]


class StagedSource:
    """The pieces of a group's parameters one rank needs, by name: ``name -> (first element, values)``."""

    def __init__(
        self, shapes: dict[str, torch.Size], dtypes: dict[str, torch.dtype], pieces: dict[str, tuple[int, torch.Tensor]]
    ) -> None:
        self._shapes, self._dtypes, self._pieces = shapes, dtypes, pieces

    def names(self) -> list[str]:
        return list(self._shapes)

    def shape(self, name: str) -> torch.Size:
        return self._shapes[name]

    def dtype(self, name: str) -> torch.dtype:
        return self._dtypes[name]

    def read_flat(self, name: str, lo: int, hi: int) -> torch.Tensor:
        check_range(name, int(self._shapes[name].numel()), lo, hi)
        start, values = self._pieces.get(name, (0, torch.empty(0, dtype=self._dtypes[name])))
        if lo < start or hi > start + values.numel():
            raise ValueError(
                f"{name}: elements [{lo}, {hi}) were not staged for this rank "
                f"(staged [{start}, {start + values.numel()}))"
            )
        return values[lo - start : hi - start].clone()


def init_store_of(param: torch.Tensor) -> InitStore | None:
    """The ``zero.Init`` store that holds ``param``'s slices (found through the registry), or ``None``."""
    owner = REGISTRY.owner_of(param)
    return owner if isinstance(owner, InitStore) and owner.owns(param) else None


def init_stores(module: nn.Module) -> list[InitStore]:
    """The ``zero.Init`` stores holding parameters of ``module`` (empty when it was built eagerly); raises while
    one of those contexts is still open. The engine keeps this list, so later changes of owner in the registry
    cannot hide a store from it."""
    stores = {id(s): s for s in (init_store_of(p) for p in module.parameters()) if s is not None}
    if any(s.active for s in stores.values()):
        raise RuntimeError(
            "hybridzero.initialize() was called inside the zero.Init block that built the model; "
            "call it after the block"
        )
    return list(stores.values())


def stage_group(
    named: Sequence[tuple[str, nn.Parameter]], mode: ShardMode, comm: Comm, stores: Sequence[InitStore]
) -> StagedSource:
    """This rank's pieces of a group of ``mode`` whose parameters are ``named`` in layout order (a collective).

    The range mirrors :class:`~hybridzero.zero.groups.ShardedGroup`: the whole buffer for DDP and persistent
    groups (laid out over one rank for persistent ones), this rank's shard otherwise."""
    world = 1 if mode is ShardMode.PERSISTENT else comm.world_size
    layout = build_layout([n for n, _ in named], [full_shape(p) for _, p in named], world)
    whole = mode in (ShardMode.DDP, ShardMode.PERSISTENT)
    lo, hi = (0, layout.padded_numel) if whole else layout.shard_range(comm.rank)
    shapes, dtypes, pieces = {}, {}, {}
    for spec, (name, param) in zip(layout.specs, named):
        full = _full_value(param, comm, stores)
        shapes[name], dtypes[name] = spec.shape, full.dtype
        hit = intersect((lo, hi), (spec.offset, spec.end))
        if hit is not None:
            a, b = hit[0] - spec.offset, hit[1] - spec.offset
            pieces[name] = (a, full.reshape(-1)[a:b].clone())
        del full  # the one whole parameter goes before the next is gathered
    return StagedSource(shapes, dtypes, pieces)


def _full_value(param: nn.Parameter, comm: Comm, stores: Sequence[InitStore]) -> torch.Tensor:
    store = next((s for s in stores if s.owns(param)), None)
    if store is not None:
        return store.full_value(param)
    with torch.no_grad():  # built outside zero.Init: whole already; rank 0's value, as for eager-built models
        full = param.detach().clone()
    comm.broadcast(full, 0, phase="init")
    return full


def release_from_init(stores: Sequence[InitStore], params: Iterable[nn.Parameter]) -> None:
    """Make ``stores`` forget ``params`` (the engine's groups hold their shards now), in the registry too."""
    plist = list(params)
    for store in stores:
        mine = [p for p in plist if store.owns(p)]
        store.release(mine)
        REGISTRY.unregister(mine, store)

"""The parameter registry's whole-shape answer: the owner's ``ds_shape`` for a partitioned parameter (whose own data
is size 0 outside a gather), the parameter's own shape otherwise. No process group needed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from hybridzero.zero.registry import REGISTRY, ParamRegistry, full_numel, full_shape


class _Owner:
    """A stand-in owner: answers ``ds_shape`` from its own table, or refuses as an engine below stage 3 does."""

    def __init__(self, shapes: dict[int, torch.Size] | None) -> None:
        self.shapes = shapes

    @contextlib.contextmanager
    def gathered(self, params: list[nn.Parameter], modifier_rank: int | None) -> Iterator[None]:
        del params, modifier_rank
        yield

    def ds_attribute(self, param: nn.Parameter, name: str) -> Any:
        if self.shapes is None or name != "ds_shape":
            raise AttributeError(name)
        return self.shapes[id(param)]


def test_full_shape_asks_the_owner_of_a_partitioned_parameter() -> None:
    size0 = nn.Parameter(torch.empty(0))
    owner = _Owner({id(size0): torch.Size([5, 7])})
    REGISTRY.register([size0], owner)
    try:
        assert full_shape(size0) == (5, 7) and full_numel(size0) == 35
    finally:
        REGISTRY.unregister([size0], owner)
    assert full_shape(size0) == (0,)  # nobody owns it any more: its own shape


def test_full_shape_of_a_whole_parameter_is_its_own() -> None:
    whole = nn.Parameter(torch.zeros(3, 5))
    assert full_shape(whole) == (3, 5) and full_numel(whole) == 15
    refusing = _Owner(None)  # an engine below stage 3 keeps parameters whole and has no ds_shape
    REGISTRY.register([whole], refusing)
    try:
        assert full_shape(whole) == (3, 5)
    finally:
        REGISTRY.unregister([whole], refusing)


def test_registry_keeps_no_owner_alive() -> None:
    registry = ParamRegistry()
    p = nn.Parameter(torch.zeros(2))
    owner = _Owner({})
    registry.register([p], owner)
    assert registry.owner_of(p) is owner
    del owner
    assert registry.owner_of(p) is None

"""Who owns a sharded parameter: the explicit, weakly referenced lookup behind DeepSpeed's engine-free API.

DeepSpeed's ``zero.GatheredParameters(params)`` and ``utils.safe_get_full_*(param)`` take bare parameters, and
DeepSpeed answers "whose shards are these?" with attributes patched onto each tensor (``param.ds_*``). We keep that
answer in one object instead: a :class:`ParamRegistry` maps a parameter (by identity, weakly) to the
:class:`ParamOwner` that holds its shards — an engine's coordinator after ``initialize``, or a ``zero.Init`` context
during construction.

Invariants:

* A parameter has at most one owner at a time; :meth:`ParamRegistry.register` replaces the previous one (``zero.Init``
  hands its parameters to the engine that ``initialize`` builds over them).
* The registry never keeps a parameter or an owner alive: keys are weak by identity (never by tensor equality) and
  values are weak references, so an engine that is garbage-collected disappears from the lookup by itself.
* Looking up a parameter nobody owns returns ``None``: callers treat it as an ordinary, whole tensor.

:data:`REGISTRY` is the one process-wide instance. It is the single piece of module-level mutable state in the
package, and it exists because the public API it serves has no other argument to carry the owner.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Protocol

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["ParamOwner", "ParamRegistry", "REGISTRY", "full_numel", "full_shape"]


class ParamOwner(Protocol):
    """Holds the shards of some parameters and can make them temporarily whole."""

    def gathered(self, params: list[torch.nn.Parameter], modifier_rank: int | None) -> AbstractContextManager[None]:
        """Full values of ``params`` inside the block; with ``modifier_rank`` its edits are written back."""
        ...


class ParamRegistry:
    """Parameter -> owner, weak on both sides (see the module docstring)."""

    def __init__(self) -> None:
        self._owners: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def register(self, params: Iterable[torch.nn.Parameter], owner: ParamOwner) -> None:
        """Make ``owner`` the owner of every parameter in ``params`` (replacing any previous owner)."""
        ref = weakref.ref(owner)
        for p in params:
            self._owners[p] = ref

    def unregister(self, params: Iterable[torch.nn.Parameter], owner: ParamOwner) -> None:
        """Forget ``params`` if (and only if) ``owner`` still owns them."""
        for p in params:
            ref = self._owners.get(p)
            if ref is not None and ref() is owner:
                del self._owners[p]

    def owner_of(self, param: torch.Tensor) -> ParamOwner | None:
        """The live owner of ``param``, or ``None`` when nobody shards it."""
        ref = self._owners.get(param)
        return None if ref is None else ref()


REGISTRY = ParamRegistry()


def full_shape(param: torch.Tensor) -> torch.Size:
    """``param``'s whole shape. A partitioned parameter's own data is DeepSpeed's size-0 tensor outside a gather,
    so its shape comes from its owner (``ds_shape``); a parameter nobody shards answers with its own shape."""
    ask = getattr(REGISTRY.owner_of(param), "ds_attribute", None)
    if ask is None:
        return param.shape
    try:
        return torch.Size(ask(param, "ds_shape"))
    except AttributeError:  # an owner that keeps its parameters whole (an engine below stage 3)
        return param.shape


def full_numel(param: torch.Tensor) -> int:
    """Elements of ``param``'s whole value (see :func:`full_shape`)."""
    return int(full_shape(param).numel())

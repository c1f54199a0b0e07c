"""The vocabulary of a gather group: what it shards (:class:`ShardMode`, chosen per ZeRO stage by
:func:`stage_mode`), where its full parameters are (:class:`GroupState`) and one parameter's place in it
(:class:`Slot`).

Pure (no collective, no tensor state): shared by :class:`hybridzero.zero.groups.ShardedGroup`, which re-exports these
names, and by ``hybridzero plan``, which lays out the same groups without building them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from torch import nn

from hybridzero.zero.layout import ParamSpec


class ShardMode(enum.Enum):
    """What a group shards (see module docstring)."""

    ZERO3 = "zero3"
    PARAMS_WHOLE = "params_whole"
    DDP = "ddp"
    PERSISTENT = "persistent"


def stage_mode(stage: int) -> ShardMode:
    """The mode of a ZeRO ``stage``'s gather groups (the persistent group is always ``PERSISTENT``); pure, shared
    by the engine and ``hybridzero plan`` so both lay out the same groups."""
    modes = {0: ShardMode.DDP, 1: ShardMode.PARAMS_WHOLE, 2: ShardMode.PARAMS_WHOLE, 3: ShardMode.ZERO3}
    if stage not in modes:
        raise ValueError(f"zero_optimization.stage = {stage!r} is invalid: expected 0, 1, 2 or 3")
    return modes[stage]


class GroupState(enum.Enum):
    """Where a group's full parameters are."""

    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


@dataclass(frozen=True)
class Slot:
    """One parameter of a group: the module's Parameter object and its place in the flat buffer."""

    param: nn.Parameter
    spec: ParamSpec
    trainable: bool

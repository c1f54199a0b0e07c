"""The engine's gather groups for a planned run, from the same functions the engine lays them out with.

:func:`group_shapes` follows ``Engine._build_groups`` step by step -- ``zero.partition.plan_groups`` (persistence
threshold at stage 3 only), ``optim.sharded.order_for_optimizer`` (one optimizer group of every trainable
parameter, frozen last), ``zero.group_types.stage_mode`` and ``zero.layout.build_layout`` (the persistent group laid out
over one rank) -- on a meta-device model, so no parameter is ever allocated. Invariant (tested against real engines
at world 1-4): every :class:`GroupShape` has the layout, mode and trainable count of the engine's ``ShardedGroup``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from hybridzero.config import Config
from hybridzero.optim import sharded
from hybridzero.zero.external import external_parameter_names
from hybridzero.zero.group_types import ShardMode, stage_mode
from hybridzero.zero.layout import FlatLayout, build_layout, intersect
from hybridzero.zero.leaf import leaf_module_names
from hybridzero.zero.partition import plan_groups
from hybridzero.zero.registry import full_shape

__all__ = ["GroupShape", "group_shapes"]


@dataclass(frozen=True)
class GroupShape:
    """One gather group as the engine would build it (metadata only)."""

    index: int
    name: str
    owner: str | None  # None: never gathered (stages 0-2, persistent)
    block: str | None  # the module the group belongs to ("" root, None persistent), whatever the stage
    mode: ShardMode
    layout: FlatLayout
    n_trainable: int
    n_params: int
    opt_range: tuple[int, int] | None  # flat range of the trainable parameters (one optimizer group)
    quantize_block: int | None  # qwZ block size of this group's primary gather

    @property
    def replicated(self) -> bool:
        """The persistent group: whole on every rank."""
        return self.mode is ShardMode.PERSISTENT

    @property
    def always_full(self) -> bool:
        """Parameters stay whole between uses (everything but ZeRO-3 groups)."""
        return self.mode is not ShardMode.ZERO3

    @property
    def master_is_whole(self) -> bool:
        """The fp32 master covers the whole buffer (DDP and the persistent group)."""
        return self.mode in (ShardMode.DDP, ShardMode.PERSISTENT)

    @property
    def has_frozen(self) -> bool:
        """Some parameter of the group is frozen."""
        return self.n_trainable < self.n_params

    @property
    def frozen_only(self) -> bool:
        """No trainable parameter (and not DDP): the group keeps no gradient shard at all."""
        return self.n_trainable == 0 and self.mode is not ShardMode.DDP

    def master_range(self, rank: int) -> tuple[int, int]:
        """Flat range this rank's master holds."""
        return (0, self.layout.padded_numel) if self.master_is_whole else self.layout.shard_range(rank)

    def optimizer_numel(self, rank: int) -> int:
        """Elements of this rank's master the optimizer steps (the trainable range, gaps between parameters
        included, tail padding not)."""
        if self.opt_range is None:
            return 0
        hit = intersect(self.master_range(rank), self.opt_range)
        return 0 if hit is None else hit[1] - hit[0]


def _qwz_block(cfg: Config, frozen_only: bool) -> int | None:
    """``Engine._qwz_block``: every group with ``zero_quantized_weights``, frozen-only groups with
    ``zero_quantized_nontrainable_weights``."""
    z = cfg.zero
    if z.quantized_weights or (z.quantized_nontrainable_weights and frozen_only):
        return z.quantization_block_size
    return None


def group_shapes(module: nn.Module, cfg: Config, world_size: int) -> list[GroupShape]:
    """The engine's gather groups for ``module`` under ``cfg`` at ``world_size`` ranks (see module docstring)."""
    stage = cfg.zero.stage
    threshold = cfg.zero.param_persistence_threshold if stage == 3 else 0
    mode = stage_mode(stage)
    index_of, _ = sharded.optimizer_groups(module, None, None)
    out: list[GroupShape] = []
    leaves = leaf_module_names(module) if cfg.zero.stage == 3 else []
    external = external_parameter_names(module) if cfg.zero.stage == 3 else set()
    for i, plan in enumerate(plan_groups(module, threshold, leaves=leaves, external=external)):
        params = [(n, module.get_parameter(n)) for n in plan.param_names]
        named = sharded.order_for_optimizer(params, index_of)
        group_mode = ShardMode.PERSISTENT if plan.replicated else mode
        world = 1 if group_mode is ShardMode.PERSISTENT else world_size
        layout = build_layout([n for n, _ in named], [full_shape(p) for _, p in named], world)
        trainable = [spec for spec, (_, p) in zip(layout.specs, named) if p.requires_grad]
        opt_range = (min(s.offset for s in trainable), max(s.end for s in trainable)) if trainable else None
        frozen_only = not trainable
        out.append(
            GroupShape(
                index=i,
                name=plan.name,
                owner=plan.owner if group_mode is ShardMode.ZERO3 else None,
                block=plan.owner,
                mode=group_mode,
                layout=layout,
                n_trainable=len(trainable),
                n_params=len(named),
                opt_range=opt_range,
                quantize_block=_qwz_block(cfg, frozen_only) if group_mode is ShardMode.ZERO3 else None,
            )
        )
    return out

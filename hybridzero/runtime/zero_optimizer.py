"""``engine.optimizer``: the torch optimizer over the fp32 master shards, answering DeepSpeed's ZeRO wrapper names.

DeepSpeed's ``engine.optimizer`` is a wrapper (``DeepSpeedZeroOptimizer``, ``DeepSpeedZeroOptimizer_Stage3``) around
the torch optimizer; code written for it reads ``optimizer.optimizer``, the flat fp32 partitions, the gradient
partitions and the loss scale from it. :class:`ZeroOptimizer` is that wrapper's shape here: a
``torch.optim.Optimizer`` that *delegates* everything (``param_groups``, ``state``, ``defaults``, ``step``,
``zero_grad``, ``state_dict``, hooks; other attributes are read through) to the one torch optimizer the engine
built, and computes DeepSpeed's names from the engine's gather groups on every read.

Sub-groups: DeepSpeed's sub-group ``j`` is optimizer param group ``j`` (its default ``sub_group_size`` splits
none). The storage behind it is one optimizer *leaf* per gather group holding elements of that param group (an
``nn.Parameter`` sharing the storage of one contiguous range of the gather group's fp32 master shard on this rank;
see :mod:`hybridzero.optim.sharded`). ``fp16_groups[j]`` are the model parameters of param group ``j`` whose
elements this rank holds (leaf by leaf), ``get_fp32_grad_partitions()[j][i]`` / ``averaged_gradients[j][i]`` this
rank's part of the fp32 gradient of ``fp16_groups[j][i]``; ``fp32_partitioned_groups_flat`` lists the leaves
themselves (keys of ``optimizer.state``), one per param group only when no param group spans several gather groups.
``step()`` is DeepSpeed's ZeRO step (unscale, norm, clip, update, propagate) and ``zero_grad()`` zeroes the gradient
shards, as DeepSpeed's wrapper's do.

Invariants: nothing is copied; every tensor answered is a view of the live master or gradient shard (a write through
it is a write to the shard, reads after a step see the step); the ranks' gradient parts of one parameter, in rank
order, are its whole reduced gradient (or, for a persistent parameter, each rank's part is the whole gradient); the
sub-group structure is recomputed from the groups on each read, so it cannot go stale. Under fp16 the gradient
shards hold loss-scaled values until ``engine.step()`` unscales them, as DeepSpeed's do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hybridzero.optim.loss_scaler import LossScaler
from hybridzero.zero.groups import ShardedGroup, ShardMode
from hybridzero.zero.layout import PARTITION_ALIGN

__all__ = ["OptimizerHost", "ParameterFetch", "SubGroup", "ZeroOptimizer", "sub_groups"]


class HookOwner(Protocol):
    """The engine's coordinator, as far as the facade reads it."""

    def forward_hooks(self) -> list[RemovableHandle]: ...


class OptimizerHost(Protocol):
    """What the facade reads from its engine (all live state; the facade keeps none of its own)."""

    groups: list[ShardedGroup]
    loss_scaler: LossScaler
    last_grad_norm: float | None
    overflow: bool

    def optimizer_step(self) -> bool:
        """The engine's ZeRO optimizer step (no scheduler, no ``zero_grad``, no counters)."""
        ...

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the engine's gradient shards."""
        ...

    @property
    def coordinator(self) -> HookOwner:
        """The engine's coordinator (its fetch hooks)."""
        ...


@dataclass(frozen=True)
class SubGroup:
    """One optimizer leaf: its gather group, its range in this rank's shard, and the parameters it covers as
    ``(param, local_lo, local_hi)`` ranges of the shard."""

    leaf: nn.Parameter
    group: ShardedGroup
    lo: int
    hi: int
    params: tuple[tuple[nn.Parameter, int, int], ...]
    param_group: int  # index in optimizer.param_groups


def _shard_start(group: ShardedGroup) -> int:
    """Flat offset of this rank's shard (0 for a whole master: persistent and stage-0 groups)."""
    return 0 if group.master_is_whole else group.layout.shard_range(group.comm.rank)[0]


def _locate(leaf: torch.Tensor, groups: Sequence[ShardedGroup]) -> tuple[ShardedGroup, int]:
    """The gather group whose master ``leaf`` views, and the leaf's offset in it (by storage identity)."""
    for group in groups:
        master = group.master
        if master.numel() and leaf.untyped_storage().data_ptr() == master.untyped_storage().data_ptr():
            return group, int(leaf.storage_offset() - master.storage_offset())
    raise RuntimeError("an optimizer leaf views no gather group's master shard (is the master offloaded to NVMe?)")


def sub_groups(optimizer: torch.optim.Optimizer, groups: Sequence[ShardedGroup]) -> list[SubGroup]:
    """Every leaf of ``optimizer`` (param groups in order), located in ``groups``, with the parameters it covers."""
    out: list[SubGroup] = []
    for index, param_group in enumerate(optimizer.param_groups):
        for leaf in param_group["params"]:
            group, lo = _locate(leaf, groups)
            hi, start = lo + leaf.numel(), _shard_start(group)
            covered = []
            for slot in group.slots:
                a, b = max(slot.spec.offset - start, lo), min(slot.spec.end - start, hi)
                if a < b and slot.trainable:
                    covered.append((slot.param, a, b))
            out.append(SubGroup(leaf, group, lo, hi, tuple(covered), index))
    return out


class ParameterFetch:
    """Stage 3: DeepSpeed's ``optimizer.parameter_offload`` (the owner of the module hooks that fetch and release
    ZeRO-3 parameters), read-only: ``forward_hooks`` are the engine's module forward hooks in effect now (none inside
    ``unwrap_model_for_generation`` / a gather-once generation block, where they are bypassed; DeepSpeed removes
    and re-registers its hooks there)."""

    def __init__(self, owner: HookOwner) -> None:
        self._owner = owner

    @property
    def forward_hooks(self) -> list[RemovableHandle]:
        """The handles of the fetch/release forward (pre-)hooks in effect (a fresh list on every read)."""
        return self._owner.forward_hooks()


class ZeroOptimizer(torch.optim.Optimizer):
    """The engine's optimizer: ``inner`` (a torch optimizer over the master leaves) with DeepSpeed's wrapper names.

    ``torch.optim.Optimizer.__init__`` is not called: ``param_groups``, ``state`` and ``defaults`` are the inner
    optimizer's own objects, so a scheduler, a checkpoint or a user editing the learning rate through either sees
    one state.
    """

    def __init__(self, inner: torch.optim.Optimizer, host: OptimizerHost, stage: int) -> None:
        # plain attributes of the facade only; everything else is read from ``inner`` (``__getattr__``)
        self.__dict__.update(_inner=inner, _host=host, _stage=stage)

    def __getattr__(self, name: str) -> Any:
        """Attributes the facade does not define are the inner optimizer's (its hook dicts, a client's extras)."""
        if name.startswith("__") or name in ("_inner", "_host", "_stage", "_inner_only"):
            raise AttributeError(name)
        own = getattr(type(self), name, None)
        if isinstance(own, property) and own.fget is not None:
            return own.fget(self)  # a stage-gated name of the facade raised: raise its own error, not the inner's
        inner = self.__dict__["_inner"]
        try:
            return getattr(inner, name)
        except AttributeError:
            raise AttributeError(
                f"engine.optimizer (hybridzero's ZeroOptimizer over {type(inner).__name__}) has no attribute {name!r}; "
                "DeepSpeed's wrapper names it answers are listed in the README (deepspeed alias section)"
            ) from None

    def __repr__(self) -> str:
        return f"ZeroOptimizer(stage={self._stage}, {self._inner!r})"

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # --- torch.optim.Optimizer, delegated ---------------------------------------------------------------------------
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """DeepSpeed's ``optimizer.optimizer``: the torch optimizer stepping the fp32 master leaves."""
        return self._inner

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._inner.param_groups = value

    @property
    def state(self) -> Any:
        return self._inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self._inner.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self._inner.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._inner.defaults = value

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """DeepSpeed's ZeRO optimizer step (every rank calls it): unscale, global norm and clipping, the inner
        optimizer's step on the master shards, propagation to the parameters (:meth:`Engine.optimizer_step`); the
        scheduler, ``zero_grad`` and the step counters are ``engine.step()``'s, as in DeepSpeed. Inside the engine's
        own update it is the inner optimizer's step (a scheduler's wrapper around this method still sees it)."""
        if self.__dict__.get("_inner_only", False):
            return self._inner.step(closure) if closure is not None else self._inner.step()
        if closure is not None:
            raise ValueError("engine.optimizer.step(closure): the ZeRO step takes no closure (as DeepSpeed's)")
        self._host.optimizer_step()
        return None

    @contextmanager
    def stepping_inner(self) -> Iterator[None]:
        """Within the block, :meth:`step` is the inner optimizer's step (the engine's update calls it so)."""
        self.__dict__["_inner_only"] = True
        try:
            yield
        finally:
            self.__dict__["_inner_only"] = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the reduced gradient shards, as DeepSpeed's ZeRO ``zero_grad`` zeroes its gradient partitions (and
        the inner optimizer's ``zero_grad``: the leaves' gradients are re-bound to the shards at each step)."""
        self._inner.zero_grad(set_to_none=set_to_none)
        self._host.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        return self._inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._inner.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise RuntimeError(
            "engine.optimizer.add_param_group: the engine's optimizer steps the fp32 master shards of the parameters "
            "it was built with; pass every param group to initialize() (model_parameters= or the client optimizer)"
        )

    # --- DeepSpeed's ZeRO wrapper names -------------------------------------------------------------------------
    def _sub_groups(self) -> list[SubGroup]:
        if self._stage == 0:
            raise AttributeError("DeepSpeed's ZeRO optimizer names exist at ZeRO stages 1-3 (this engine runs stage 0)")
        return sub_groups(self._inner, self._host.groups)

    def _by_param_group(self) -> list[list[SubGroup]]:
        """The leaves of each optimizer param group (DeepSpeed's sub-groups, ``sub_group_size`` never splitting)."""
        out: list[list[SubGroup]] = [[] for _ in self._inner.param_groups]
        for sg in self._sub_groups():
            out[sg.param_group].append(sg)
        return out

    @property
    def fp16_groups(self) -> list[list[nn.Parameter]]:
        """Per optimizer param group (DeepSpeed's sub-group), the model parameters whose elements this rank holds."""
        return [[p for sg in leaves for p, _, _ in sg.params] for leaves in self._by_param_group()]

    @property
    def bit16_groups(self) -> list[list[nn.Parameter]]:
        """DeepSpeed's stage 1/2 name of :attr:`fp16_groups`."""
        return self.fp16_groups

    @property
    def fp32_partitioned_groups_flat(self) -> list[nn.Parameter]:
        """Per optimizer leaf, the fp32 master leaf (live: shares the master shard's storage; a key of ``state``).
        A param group spread over several gather groups has one leaf in each, so entry ``j`` is param group ``j``'s
        flat fp32 partition only when every param group has one leaf (a model without blocks)."""
        return [sg.leaf for sg in self._sub_groups()]

    @property
    def single_partition_of_fp32_groups(self) -> list[nn.Parameter]:
        """DeepSpeed's stage 1/2 name of :attr:`fp32_partitioned_groups_flat`."""
        return self.fp32_partitioned_groups_flat

    def get_fp32_grad_partitions(self) -> dict[int, dict[int, torch.Tensor]]:
        """``{param_group: {i: this rank's part of the fp32 gradient of fp16_groups[param_group][i]}}``: views of the
        reduced (averaged, accumulated over micro-steps) gradient shards; the last parameter of a gather group
        includes the shard's zero padding, as DeepSpeed's padded partitions do."""
        return {j: dict(enumerate(parts)) for j, parts in enumerate(self._parts_by_param_group())}

    @property
    def averaged_gradients(self) -> dict[int, list[torch.Tensor]]:
        """``{param_group: [gradient parts]}``, as :meth:`get_fp32_grad_partitions` (gradients are reduced at the
        end of every backward here, so ``engine.allreduce_gradients()`` has nothing left to do)."""
        return dict(enumerate(self._parts_by_param_group()))

    def _parts_by_param_group(self) -> list[list[torch.Tensor]]:
        """This rank's gradient parts of ``fp16_groups[j]``'s parameters, for each param group ``j``."""
        return [[part for sg in leaves for part in _grad_parts(sg)] for leaves in self._by_param_group()]

    @property
    def parameter_offload(self) -> ParameterFetch:
        """Stage 3 only: the parameter fetch hooks' owner (:class:`ParameterFetch`)."""
        if self._stage != 3:
            raise AttributeError(f"parameter_offload: DeepSpeed's ZeRO-3 name (this engine runs stage {self._stage})")
        return ParameterFetch(self._host.coordinator)

    @property
    def _global_grad_norm(self) -> float | None:
        """The global gradient norm (before clipping) of the last applied step; ``None`` before the first."""
        return self._host.last_grad_norm

    @property
    def loss_scale(self) -> float:
        """The current loss scale (fp16; 1.0 otherwise)."""
        return self._host.loss_scaler.scale

    @property
    def cur_scale(self) -> float:
        """DeepSpeed's loss scaler's name of :attr:`loss_scale`."""
        return self.loss_scale

    def _whole_stage(self, name: str) -> None:
        if self._stage not in (1, 2):
            raise AttributeError(
                f"{name}: DeepSpeed's ZeRO stage 1/2 optimizer name, answered at stages 1-2 (this engine runs stage "
                f"{self._stage})"
            )

    @property
    def nccl_start_alignment_factor(self) -> int:
        """Stages 1-2: every rank's partition of a gather group's flat buffer starts at a multiple of this many
        elements (4 bytes in 16-bit), as DeepSpeed's all-gather send buffers do (``zero.layout.PARTITION_ALIGN``)."""
        self._whole_stage("nccl_start_alignment_factor")
        return PARTITION_ALIGN

    @property
    def parallel_partitioned_bit16_groups(self) -> list[list[torch.Tensor]]:
        """Stages 1-2: per gather group (not per sub-group), the ranks' partitions of its flat compute-dtype buffer
        in rank order -- live views of the whole parameters this rank computes with (DeepSpeed's are per optimizer
        param group)."""
        self._whole_stage("parallel_partitioned_bit16_groups")
        out = []
        for group in self._host.groups:
            assert group.full is not None  # stages 1-2: every group is whole on every rank
            size = group.layout.shard_numel
            out.append([group.full[r * size : (r + 1) * size] for r in range(group.layout.world_size)])
        return out

    @property
    def overflow(self) -> bool:
        """Whether the last boundary step was skipped for inf/nan gradients (``engine.overflow``)."""
        return self._host.overflow


def _grad_parts(sg: SubGroup) -> list[torch.Tensor]:
    """Views of the gradient shard for each parameter of ``sg`` (the stage-0 whole copy is not a shard: refused)."""
    if sg.group.mode is ShardMode.DDP:
        raise AttributeError("gradient partitions exist at ZeRO stages 1-3")
    shard, last = sg.group.grad_shard, sg.group.slots[-1].param
    return [shard[a : shard.numel() if p is last else b] for p, a, b in sg.params]

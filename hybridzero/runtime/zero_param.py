"""DeepSpeed's read-only ZeRO-3 parameter attributes (``ds_id``, ``ds_shape``, ``ds_numel``, ``ds_tensor``,
``ds_status``).

DeepSpeed sets these attributes on every parameter of a ZeRO-3 model, and code written for it (its own unit tests,
``hasattr(p, "ds_id")`` checks in user code) reads them. hybridzero stores no state on tensors: a ZeRO-3 engine
instead gives each of its parameters the class :class:`ZeroParameter`, an ``nn.Parameter`` subclass whose
attributes are *properties computed from the engine* (found through :data:`hybridzero.zero.registry.REGISTRY`, as
``deepspeed.utils`` finds it). The class change is torch's own mechanism for a parameter changing kind
(``UninitializedParameter.materialize``); nothing is written into the tensor, and ``engine.destroy()`` gives the
parameters back their plain class.

Invariants: a ``ZeroParameter`` no engine owns (a copy, or after ``destroy``) has none of the attributes
(``hasattr`` is False, as for a plain parameter); the attributes are read-only; ``ds_tensor`` is a copy of this
rank's part of the parameter in the compute dtype, flattened, exactly the size of ``safe_get_local_fp32_param``'s
answer (DeepSpeed's partition of the parameter; here cut at the gather group's partition boundaries).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from hybridzero.runtime.fragments import TensorFragments, master_range, param_part
from hybridzero.runtime.zero.partition_parameters import ZeroParamStatus
from hybridzero.zero.groups import GroupState, ShardedGroup, Slot
from hybridzero.zero.registry import REGISTRY

__all__ = ["ZeroParameter", "adopt", "release"]


class ZeroParameter(nn.Parameter):
    """A parameter of a ZeRO-3 engine, with DeepSpeed's ``ds_*`` attributes as read-only properties."""

    def _where(self, name: str) -> tuple[TensorFragments, ShardedGroup, Slot]:
        owner = REGISTRY.owner_of(self)
        if not isinstance(owner, TensorFragments):
            raise AttributeError(f"{name}: this parameter belongs to no ZeRO-3 engine")
        group, slot = owner.zero.locate(self)
        return owner, group, slot

    @property
    def ds_id(self) -> int:
        """The parameter's position among its engine's parameters (unique within the engine)."""
        owner, _, slot = self._where("ds_id")
        return next(i for i, p in enumerate(owner.zero.params()) if p is slot.param)

    @property
    def ds_shape(self) -> torch.Size:
        """The parameter's full shape (``.shape`` is empty outside a gather)."""
        return torch.Size(self._where("ds_shape")[2].spec.shape)

    @property
    def ds_numel(self) -> int:
        """The parameter's full number of elements."""
        return int(self.ds_shape.numel())

    @property
    def ds_status(self) -> ZeroParamStatus:
        """Whether the full value is on this rank now: its gather group's state, in DeepSpeed's words.

        A group that is never partitioned (persistent parameters) is always ``AVAILABLE``.
        """
        _, group, _ = self._where("ds_status")
        if group.always_full or group.state is GroupState.GATHERED:
            return ZeroParamStatus.AVAILABLE
        if group.state is GroupState.GATHERING:
            return ZeroParamStatus.INFLIGHT
        return ZeroParamStatus.NOT_AVAILABLE

    @property
    def ds_tensor(self) -> torch.Tensor:
        """A copy of this rank's part of the parameter in the compute dtype, flattened (possibly empty)."""
        _, group, slot = self._where("ds_tensor")
        part = param_part(master_range(group), slot)
        with group.master_resident() as master:  # NVMe offload: read from its file
            local = master[part[0] : part[1]] if part else master.new_empty(0)
            return local.to(group.compute_dtype, copy=True)


def _swap(params: Iterable[nn.Parameter], old: type[nn.Parameter], new: type[nn.Parameter]) -> None:
    for p in params:
        if type(p) is old:
            p.__class__ = new


def adopt(params: Iterable[nn.Parameter]) -> None:
    """Give plain parameters the class :class:`ZeroParameter` (other subclasses are left as they are)."""
    _swap(params, nn.Parameter, ZeroParameter)


def release(params: Iterable[nn.Parameter]) -> None:
    """Give :class:`ZeroParameter` parameters back their plain class."""
    _swap(params, ZeroParameter, nn.Parameter)

"""An engine's answers to DeepSpeed's ``ds_*`` attributes (:mod:`hybridzero.zero.param_view`) at ZeRO-3.

``ds_tensor`` is a copy of this rank's part of the parameter in the compute dtype, flattened, exactly the size of
``safe_get_local_fp32_param``'s answer (DeepSpeed's partition of the parameter; here cut at the gather group's partition
boundaries); ``ds_tensor.data = value`` writes that part, as ``safe_set_local_fp32_param`` does. ``ds_status`` is
the parameter's gather group's state: ``AVAILABLE`` while the group is whole (inside
``GatheredParameters``, a forward, a generation block, or always for a persistent group but after
``empty_partition_cache()``), ``INFLIGHT`` while its all-gather is in flight, else ``NOT_AVAILABLE``. ``ds_persist``
is whether the parameter's group is the persistent one (parameters of at most ``stage3_param_persistence_threshold``
elements, whole on every rank). At stages 0-2 there are no such attributes (as in DeepSpeed).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridzero.runtime.fragments import FragmentHost, TensorFragments, master_range, param_part
from hybridzero.zero.gathered import ZeroParamOwner
from hybridzero.zero.group_types import GroupState
from hybridzero.zero.param_view import DS_ATTRIBUTES, LocalPart, ZeroParameter, ZeroParamStatus, adopt, release
from hybridzero.zero.registry import REGISTRY

__all__ = ["EngineParams", "ZeroParameter", "adopt", "release", "take_over"]


class EngineParams(TensorFragments):
    """An engine's parameter owner: the fragment API plus DeepSpeed's ``ds_*`` answers (``DsOwner``)."""

    def __init__(self, zero: ZeroParamOwner, host: FragmentHost, stage: int) -> None:
        super().__init__(zero, host)
        self.stage = stage
        # ds_id by identity, computed once: the engine's parameter list is fixed at construction, and DeepSpeed-Chat
        # reads ds_id per parameter every step (hasattr in _z3_params_to_fetch), so a scan per read would be O(n^2)
        self.ds_ids = {id(p): i for i, p in enumerate(zero.params())}

    def ds_attribute(self, param: nn.Parameter, name: str) -> Any:
        """The answer for ``name`` (one of ``DS_ATTRIBUTES``) on one of this engine's parameters."""
        return _answer(self, param, name)


def take_over(module: nn.Module) -> None:
    """Hand ``module`` over from the live engines that hold its parameters (a second ``initialize`` over one model,
    as DeepSpeed's checkpoint tests do). At ZeRO-3 each of their gather groups is gathered once, in their group
    order (the same on every rank), and its parameters keep the whole values, so the model is whole on every rank as
    an eager-built one is; then those engines are destroyed (one engine drives a model's hooks). Raises, changing
    nothing, if such an engine drives another module (a shared submodule): that engine's model would break."""
    engines: dict[int, Any] = {}
    for p in module.parameters():
        owner = REGISTRY.owner_of(p)
        if isinstance(owner, EngineParams):
            engines.setdefault(id(owner.host), owner.host)
    for engine in engines.values():
        if engine.module is not module:
            raise ValueError(
                "initialize(model=...): some parameters belong to a live engine over another module (a shared "
                "submodule); call destroy() on that engine first"
            )
    for engine in engines.values():
        if engine.param_owner.stage == 3:
            for group in engine.groups:
                params = [slot.param for slot in group.slots]
                with engine.param_owner.gathered(params, None), torch.no_grad():
                    values = [p.detach().clone() for p in params]
                for p, value in zip(params, values):
                    p.data = value
        engine.destroy()


def _answer(fragments: EngineParams, param: nn.Parameter, name: str) -> Any:
    if fragments.stage != 3 or name not in DS_ATTRIBUTES:
        raise AttributeError(f"{name}: provided for ZeRO-3 parameters only (this engine runs stage {fragments.stage})")
    group, slot = fragments.zero.locate(param)
    if name == "ds_id":
        return fragments.ds_ids[id(slot.param)]
    if name in ("ds_shape", "ds_numel"):
        return torch.Size(slot.spec.shape)
    if name == "ds_persist":
        return group.replicated
    if name == "ds_status":
        if group.state is GroupState.GATHERED:  # a persistent group is, unless empty_partition_cache evicted it
            return ZeroParamStatus.AVAILABLE
        return ZeroParamStatus.INFLIGHT if group.state is GroupState.GATHERING else ZeroParamStatus.NOT_AVAILABLE
    part = param_part(master_range(group), slot)
    with group.master_resident() as master:  # NVMe offload: read from its file
        local = master[part[0] : part[1]] if part else master.new_empty(0)
        copy = local.to(group.compute_dtype, copy=True)
    return LocalPart.of(copy, lambda value: fragments.set_local_fp32(slot.param, value))

"""DeepSpeed's ``deepspeed.zero.register_external_parameter``: a parameter a module's forward uses but does not own.

Under ZeRO-3 a parameter is whole only while its gather group is (:mod:`hybridzero.zero.partition`): around its
block's forward, or the whole root forward for the root group. A module whose forward reads a parameter of another
block (``self.other.weight``) would find it size 0 there. DeepSpeed's answer is to register it on the module that
uses it; here a registered parameter joins the root group (or the persistent one, if small enough), so it is whole
for the whole root forward, wherever it is read (and the registering module, called on its own outside a forward,
gathers the root group first, as modules holding root parameters do).

The registration is DeepSpeed's own mark on the module, its ``_external_params`` dict (a module attribute, as
DeepSpeed keeps it; nothing is stored on tensors). It is read once, when ``initialize`` plans the gather groups.
After that, registering a parameter that is already whole throughout the root forward (root or persistent group) is
a no-op, as DeepSpeed models that register in their ``forward`` need; registering one of a block's parameters then
is an error naming it (the gather groups are fixed at ``initialize``: register in the module's ``__init__``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from hybridzero.zero.registry import REGISTRY

__all__ = [
    "external_parameter_names",
    "external_parameters",
    "register_external_parameter",
    "unregister_external_parameter",
]

_ATTR = "_external_params"


def _registered(module: nn.Module) -> dict[int, nn.Parameter]:
    found = getattr(module, _ATTR, None)
    return found if isinstance(found, dict) else {}


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Declare that ``module``'s forward uses ``parameter``, which another module owns (see module docstring)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"register_external_parameter: module must be an nn.Module, got {type(module).__name__}")
    if not isinstance(parameter, nn.Parameter):
        raise TypeError(
            f"register_external_parameter: parameter must be an nn.Parameter, got {type(parameter).__name__}"
        )
    _check_after_initialize(parameter)
    marks = _registered(module)
    marks[id(parameter)] = parameter
    setattr(module, _ATTR, marks)


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Undo :func:`register_external_parameter` (before ``initialize``; a parameter not registered: ``ValueError``)."""
    marks = _registered(module)
    if id(parameter) not in marks:
        raise ValueError("unregister_external_parameter: this parameter is not registered on this module")
    del marks[id(parameter)]


def external_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters registered on ``module`` itself (not its submodules), in registration order."""
    return list(_registered(module).values())


def external_parameter_names(model: nn.Module) -> set[str]:
    """The first names (in ``model.named_parameters()``) of the parameters registered on any module of ``model``;
    a registered parameter that is not one of ``model``'s is an error naming the module."""
    first = {id(p): n for n, p in model.named_parameters()}
    out: set[str] = set()
    for mod_name, module in model.named_modules():
        for pid in _registered(module):
            if pid not in first:
                raise ValueError(
                    f"register_external_parameter: a parameter registered on module {mod_name or '<root>'!r} is not "
                    "a parameter of the model passed to initialize"
                )
            out.add(first[pid])
    return out


def _check_after_initialize(parameter: nn.Parameter) -> None:
    """An engine already owns ``parameter``: fine if its group is whole for the whole root forward, else refused."""
    owner: Any = REGISTRY.owner_of(parameter)
    locate = getattr(getattr(owner, "zero", None), "locate", None)
    if locate is None:
        return  # no engine yet (plain, or under zero.Init): read at initialize
    group, slot = locate(parameter)
    if group.replicated or group.owner in ("", None):
        return
    raise RuntimeError(
        f"register_external_parameter: {slot.spec.name!r} belongs to the gather group of {group.owner!r}, and the "
        "gather groups were planned at initialize; register it before initialize (in the module's __init__) so that "
        "it is whole for the whole forward"
    )

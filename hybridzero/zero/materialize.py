"""Sharded construction: a model built on the meta device is materialized one gather group at a time.

The module tree and parameter shapes come from the meta model; for each group the engine asks
:func:`materialize_group` for real parameters, initializes them with the model's own init (Hugging Face's
``_init_weights`` or ``reset_parameters``), shards them and drops the full values before the next group. So no
rank ever holds more than one group's full parameters.

Invariants: a tied parameter gets one new ``nn.Parameter`` installed under every one of its names (ties survive);
``requires_grad`` is preserved; non-parameter buffers (rotary tables, masks) are materialized up front (they are
small) and initialized the same way; a buffer the init cannot fill raises, naming it.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

InitFn = Callable[[nn.Module], None]


def has_meta(module: nn.Module) -> bool:
    """True if any parameter or buffer of ``module`` lives on the meta device."""
    return any(t.is_meta for t in module.parameters()) or any(b.is_meta for b in module.buffers())


def default_init_fn(model: nn.Module) -> InitFn:
    """The model's own per-module init: HF ``_init_weights`` if any (also in a wrapped submodule), else
    ``reset_parameters``."""
    owner = next((m for m in model.modules() if callable(getattr(m, "_init_weights", None))), None)

    def init(module: nn.Module) -> None:
        if owner is not None:
            owner._init_weights(module)
        elif callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()
    return init


def _owner_and_attr(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (model.get_submodule(path) if path else model), attr


def materialize_buffers(model: nn.Module, device: torch.device, init_fn: InitFn) -> None:
    """Give every meta buffer real storage and run the init on the modules that own them."""
    owners = []
    for mod in model.modules():
        metas = [n for n, b in mod.named_buffers(recurse=False) if b is not None and b.is_meta]
        for n in metas:
            buf = mod._buffers[n]
            mod._buffers[n] = torch.zeros(buf.shape, dtype=buf.dtype, device=device)
        if metas:
            owners.append((mod, metas))
    for mod, _ in owners:
        init_fn(mod)
    for mod, names in owners:
        for n in names:
            if mod._buffers[n] is None or mod._buffers[n].is_meta:
                raise RuntimeError(f"buffer {type(mod).__name__}.{n} could not be materialized from the meta device")


def materialize_group(model: nn.Module, aliases: Sequence[Sequence[str]], device: torch.device,
                      init_fn: InitFn | None) -> list[nn.Parameter]:
    """Real parameters for one group (given as the alias lists of its parameters), in order; initialized by
    ``init_fn``, or left uninitialized (``torch.empty``: no pages touched) when values come from a checkpoint."""
    out: list[nn.Parameter] = []
    touched: dict[int, nn.Module] = {}
    for names in aliases:
        old = model.get_parameter(names[0])
        if not old.is_meta:
            out.append(old)
            continue
        new = nn.Parameter(torch.empty(old.shape, dtype=old.dtype, device=device), requires_grad=old.requires_grad)
        for name in names:
            owner, attr = _owner_and_attr(model, name)
            owner._parameters[attr] = new
            touched[id(owner)] = owner
        out.append(new)
    if init_fn is not None:
        with torch.no_grad():
            for owner in touched.values():
                init_fn(owner)
    return out

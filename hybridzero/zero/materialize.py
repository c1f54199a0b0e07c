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
    hf_init: InitFn | None = None if owner is None else owner._init_weights  # type: ignore[assignment]

    def init(module: nn.Module) -> None:
        reset = getattr(module, "reset_parameters", None)
        if hf_init is not None:
            hf_init(module)
        elif callable(reset):
            reset()

    return init


def move_buffers(model: nn.Module, device: torch.device) -> nn.Module:
    """Move every buffer of ``model`` to ``device`` in place (parameters untouched); returns ``model``."""
    for mod in model.modules():
        for name, buf in mod._buffers.items():
            if buf is not None and buf.device != device:
                mod._buffers[name] = buf.to(device)
    return model


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
            assert buf is not None  # metas lists only non-None buffers
            mod._buffers[n] = torch.zeros(buf.shape, dtype=buf.dtype, device=device)
        if metas:
            owners.append((mod, metas))
    for mod, _ in owners:
        init_fn(mod)
    for mod, names in owners:
        for n in names:
            done = mod._buffers[n]
            if done is None or done.is_meta:
                raise RuntimeError(f"buffer {type(mod).__name__}.{n} could not be materialized from the meta device")


def materialize_group(
    model: nn.Module, aliases: Sequence[Sequence[str]], device: torch.device, init_fn: InitFn | None
) -> list[nn.Parameter]:
    """Real parameters for one group (given as the alias lists of its parameters), in order; initialized by
    ``init_fn``, or left uninitialized (``torch.empty``: no pages touched) when values come from a checkpoint."""
    touched: dict[int, nn.Module] = {}
    for names in aliases:
        for name in names:
            owner, _ = _owner_and_attr(model, name)
            touched[id(owner)] = owner
    # every meta parameter of every owner module, also those of later groups (a Linear whose bias is persisted
    # while its weight is sharded): the module's init then runs once, on real tensors, before anything is sharded
    fresh = []
    for owner in touched.values():
        metas = [p for p in owner._parameters.values() if p is not None and p.is_meta]
        for old in metas:
            _install(model, old, torch.empty(old.shape, dtype=old.dtype, device=device))
        if metas:
            fresh.append(owner)  # initialized exactly once, when its parameters become real
    if init_fn is not None:
        with torch.no_grad():
            for owner in fresh:
                init_fn(owner)
    return [model.get_parameter(names[0]) for names in aliases]


def _install(model: nn.Module, old: nn.Parameter, data: torch.Tensor) -> None:
    """Replace ``old`` by a new Parameter on ``data`` under every name it has in ``model`` (ties survive)."""
    new = nn.Parameter(data, requires_grad=old.requires_grad)
    for mod in model.modules():
        for attr, p in list(mod._parameters.items()):
            if p is old:
                mod._parameters[attr] = new

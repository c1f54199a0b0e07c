"""``deepspeed.compression.helper``: ``recursive_getattr`` / ``recursive_setattr`` over dotted submodule names."""

from __future__ import annotations

from torch import nn

__all__ = ["recursive_getattr", "recursive_setattr"]


def recursive_getattr(model: nn.Module, module_name: str) -> nn.Module:
    """The submodule at dotted path ``module_name`` (e.g. ``"decoder.layers.0.fc1"``); AttributeError names the
    missing part."""
    module: nn.Module = model
    for part in module_name.split("."):
        module = getattr(module, part)
    return module


def recursive_setattr(model: nn.Module, module_name: str, module: nn.Module) -> None:
    """Replace the submodule at dotted path ``module_name`` with ``module`` (its parent must exist)."""
    parent_name, _, leaf = module_name.rpartition(".")
    parent = recursive_getattr(model, parent_name) if parent_name else model
    setattr(parent, leaf, module)

"""``deepspeed.utils``' tensor-fragment API: one parameter's fp32 value, gradient and optimizer state.

Each function takes a parameter of an engine's module (``engine.module``'s parameter objects) and finds its engine
through :data:`hybridzero.zero.registry.REGISTRY`; the work is :class:`hybridzero.runtime.fragments.TensorFragments`'
(read it for the coordinates and invariants). As in DeepSpeed:

* every rank calls the ``full`` functions and ``safe_set_*`` together (they may be collectives) and passes the same
  whole value to ``safe_set_full_*``;
* gradients are valid after ``backward`` at the accumulation boundary, before ``step`` (the reduced, averaged fp32
  gradient; fp16: unscaled);
* a parameter no engine owns (before ``initialize``) gives ``None`` (``safe_get_full_grad``: its ``.grad``);
* optimizer state keys are the optimizer's per-element ones (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``).

Frozen parameters read as ``None`` everywhere (fp32 value, gradient, optimizer state), as in DeepSpeed, which keeps
no fp32 copy of them (read their values with ``GatheredParameters``); ``safe_set_*_fp32_param`` on a frozen parameter
writes its value (DeepSpeed silently ignores that write).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridzero.runtime.fragments import TensorFragments
from hybridzero.zero.registry import REGISTRY

__all__ = [
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
]


def _fragments(param: torch.Tensor, what: str, required: bool) -> TensorFragments | None:
    owner = REGISTRY.owner_of(param)
    if isinstance(owner, TensorFragments):
        return owner
    if owner is not None:
        raise RuntimeError(
            f"{what}: the parameter is still under construction (zero.Init); call it after hybridzero.initialize"
        )
    if required:
        raise ValueError(
            f"{what}: the parameter belongs to no engine; pass a parameter of engine.module after hybridzero.initialize"
        )
    return None


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """The whole fp32 (master) value of ``param`` on every rank (None for a frozen parameter)."""
    frag = _fragments(param, "safe_get_full_fp32_param", required=False)
    return None if frag is None else frag.full_fp32(param)


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The whole reduced fp32 gradient of ``param`` on every rank (None for a frozen parameter)."""
    frag = _fragments(param, "safe_get_full_grad", required=False)
    return param.grad if frag is None else frag.full_grad(param)


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """The whole optimizer state ``optim_state_key`` of ``param`` on every rank."""
    frag = _fragments(param, "safe_get_full_optimizer_state", required=False)
    return None if frag is None else frag.full_optimizer_state(param, optim_state_key)


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set the whole fp32 value of ``param`` (every rank, same ``value``); the next forward uses it."""
    frag = _fragments(param, "safe_set_full_fp32_param", required=True)
    assert frag is not None
    frag.set_full_fp32(param, value)


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Set the whole optimizer state ``optim_state_key`` of ``param`` (every rank, same ``value``)."""
    frag = _fragments(param, "safe_set_full_optimizer_state", required=True)
    assert frag is not None
    frag.set_full_optimizer_state(param, value, optim_state_key)


def safe_get_local_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's part of ``param``'s fp32 value, flattened (possibly empty)."""
    frag = _fragments(param, "safe_get_local_fp32_param", required=False)
    return None if frag is None else frag.local_fp32(param)


def safe_get_local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's part of ``param``'s reduced fp32 gradient, flattened."""
    frag = _fragments(param, "safe_get_local_grad", required=False)
    return param.grad if frag is None else frag.local_grad(param)


def safe_get_local_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """This rank's part of ``param``'s optimizer state ``optim_state_key``, flattened."""
    frag = _fragments(param, "safe_get_local_optimizer_state", required=False)
    return None if frag is None else frag.local_optimizer_state(param, optim_state_key)


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set this rank's part of ``param``'s fp32 value (every rank calls it, each with its own part)."""
    frag = _fragments(param, "safe_set_local_fp32_param", required=True)
    assert frag is not None
    frag.set_local_fp32(param, value)


def safe_set_local_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Set this rank's part of ``param``'s optimizer state ``optim_state_key``."""
    frag = _fragments(param, "safe_set_local_optimizer_state", required=True)
    assert frag is not None
    frag.set_local_optimizer_state(param, value, optim_state_key)


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Replace ``param``'s reduced gradient with the whole ``value`` (every rank, the same value; read back by
    :func:`safe_get_full_grad`); the next ``step`` uses it. A parameter no engine owns: its ``.grad`` is written."""
    frag = _fragments(param, "safe_set_full_grad", required=False)
    if frag is None:
        if param.grad is None:
            raise ValueError("safe_set_full_grad: the parameter belongs to no engine and has no .grad to write")
        with torch.no_grad():
            param.grad.copy_(value)
        return
    frag.set_full_grad(param, value)


def safe_set_local_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Replace this rank's part of ``param``'s reduced gradient (shaped as :func:`safe_get_local_grad` gives it)."""
    frag = _fragments(param, "safe_set_local_grad", required=True)
    assert frag is not None
    frag.set_local_grad(param, value)


def safe_update_full_grad_vectorized(
    param_list: list[torch.nn.Parameter], update_func: Callable[[torch.Tensor, torch.nn.Parameter], torch.Tensor]
) -> None:
    """For each trainable parameter: its gradient becomes ``update_func(full_grad, param)`` (every rank calls it with
    the same list; frozen parameters are skipped, as in DeepSpeed)."""
    for p in param_list:
        if not p.requires_grad:
            continue
        grad = safe_get_full_grad(p)
        if grad is not None:
            safe_set_full_grad(p, update_func(grad, p))

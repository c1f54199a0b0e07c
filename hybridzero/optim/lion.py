"""The Lion optimizer (Chen et al., "Symbolic Discovery of Optimization Algorithms", 2023), which DeepSpeed's config
names ``"Lion"`` and its ``deepspeed.ops.lion`` provides as compiled kernels; torch has none, so it is written here.

One step, per element, with momentum ``m`` (``exp_avg``), gradient ``g``, learning rate ``lr``:

* ``c = beta1 * m + (1 - beta1) * g`` (the interpolation whose sign is the update);
* ``p = p * (1 - lr * weight_decay) - lr * sign(c)`` (decoupled weight decay, as DeepSpeed's kernels apply it);
* ``m = beta2 * m + (1 - beta2) * g``.

``sign(0) = 0``: an element whose interpolation is exactly 0 (a zero gradient on a zero momentum: an unused
embedding row, a frozen slice) does not move, as in the paper's and optax's Lion. DeepSpeed's two kernels disagree
with each other there (the CUDA one moves it by ``+lr``, the CPU one by ``-lr`` or ``+lr`` after the sign bit of
the zero). The coefficients (``1 - beta``, the decay factor) are formed in fp32, as those kernels form them.

Invariants (unit-tested): the step is elementwise, so a step over any partition of the elements into tensors
(ZeRO's flat shards) equals the step over the whole tensor bit for bit; the state is ``{"exp_avg"}`` in the
parameter's dtype, created as zeros at the first step; ``maximize`` negates the gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["Lion", "fp32_coefficients", "lion_step"]

Params = Iterable[torch.Tensor] | Iterable[dict[str, Any]]


def lion_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
) -> None:
    """One Lion update of ``params`` and ``exp_avgs`` in place from ``grads`` (see the module docstring), with the
    coefficients rounded as DeepSpeed's kernels compute them (:func:`fp32_coefficients`)."""
    if not params:
        return
    b1, keep1, b2, keep2, decay, step = fp32_coefficients(lr, beta1, beta2, weight_decay)
    interp = torch._foreach_mul(exp_avgs, b1)
    torch._foreach_add_(interp, grads, alpha=keep1)
    torch._foreach_sign_(interp)
    if weight_decay != 0.0:
        torch._foreach_mul_(params, decay)
    torch._foreach_add_(params, interp, alpha=-step)
    torch._foreach_mul_(exp_avgs, b2)
    torch._foreach_add_(exp_avgs, grads, alpha=keep2)


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def fp32_coefficients(
    lr: float, beta1: float, beta2: float, weight_decay: float
) -> tuple[float, float, float, float, float, float]:
    """``(beta1, 1 - beta1, beta2, 1 - beta2, 1 - lr * weight_decay, lr)`` as fp32 arithmetic gives them: DeepSpeed's
    CPU and CUDA kernels take the hyperparameters as fp32 and form ``1 - beta`` and the decay factor in fp32, so
    ``1 - 0.999`` is ``0.00099998713``, not ``0.001``; a momentum built with the latter drifts from theirs by 1e-5
    relative every step, enough to flip the sign of an update near 0."""
    b1, b2, step = _f32(beta1), _f32(beta2), _f32(lr)
    return b1, _f32(1.0 - b1), b2, _f32(1.0 - b2), _f32(1.0 - _f32(step * _f32(weight_decay))), step


def _check(lr: float, betas: tuple[float, float], weight_decay: float) -> None:
    """Refuse hyperparameters outside Lion's domain, naming the argument and its value."""
    if not lr >= 0.0:
        raise ValueError(f"Lion: lr = {lr!r} is invalid; expected a number >= 0")
    for i, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Lion: betas[{i}] = {beta!r} is invalid; expected 0 <= beta < 1")
    if not weight_decay >= 0.0:
        raise ValueError(f"Lion: weight_decay = {weight_decay!r} is invalid; expected a number >= 0")


class Lion(torch.optim.Optimizer):
    """``Lion(params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, maximize=False)``: DeepSpeed's defaults (its
    config's ``"Lion"`` and its classes, :mod:`hybridzero.ops.lion`); the paper suggests ``lr`` 3-10x below AdamW's
    and ``betas=(0.9, 0.99)``."""

    def __init__(
        self,
        params: Params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        maximize: bool = False,
    ) -> None:
        betas = (float(betas[0]), float(betas[1]))
        _check(lr, betas, weight_decay)
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay, "maximize": maximize})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every parameter with a gradient; returns ``closure()`` (evaluated with grad on) if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, exp_avgs = [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lion does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                params.append(p)
                grads.append(-p.grad if group.get("maximize", False) else p.grad)
                exp_avgs.append(state["exp_avg"])
            beta1, beta2 = group["betas"]
            lion_step(
                params, grads, exp_avgs, lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"]
            )
        return loss

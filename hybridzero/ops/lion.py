"""``deepspeed.ops.lion``: ``DeepSpeedCPULion`` and ``FusedLion`` as :class:`hybridzero.optim.lion.Lion` with
DeepSpeed's signatures and defaults (``lr=1e-3``, ``betas=(0.9, 0.999)``, ``weight_decay=0``).

DeepSpeed's two classes are compiled kernels (an AVX CPU loop, a multi-tensor CUDA kernel) of the same update;
hybridzero has no compiled ops, so both are the one torch implementation (see :mod:`hybridzero.optim.lion` for the
update and the one place it differs from DeepSpeed's kernels: an exactly-zero interpolation does not move the
element). ``DeepSpeedCPULion(fp32_optimizer_states=False)`` is refused by name (hybridzero's masters are fp32, and
the momentum follows them); ``FusedLion.zero_grad`` sets gradients to ``None`` when ``set_grad_none`` (DeepSpeed's
default). Each class records its DeepSpeed-only arguments in ``defaults`` so ``cls(params, **defaults)`` rebuilds
the same optimizer (what :func:`hybridzero.initialize` does with a client optimizer).
"""

from __future__ import annotations

from hybridzero.ops.states import require_fp32_states
from hybridzero.optim.lion import Lion, Params

__all__ = ["DeepSpeedCPULion", "FusedLion"]


class DeepSpeedCPULion(Lion):
    """DeepSpeed's ``DeepSpeedCPULion(model_params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0,
    fp32_optimizer_states=True)`` (see the module docstring)."""

    def __init__(
        self,
        model_params: Params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        fp32_optimizer_states: bool = True,
    ) -> None:
        require_fp32_states("DeepSpeedCPULion", fp32_optimizer_states)
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay)
        self.defaults.update(fp32_optimizer_states=True)


class FusedLion(Lion):
    """DeepSpeed's ``FusedLion(params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, set_grad_none=True)``."""

    def __init__(
        self,
        params: Params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        set_grad_none: bool = True,
    ) -> None:
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay)
        self.set_grad_none = set_grad_none
        self.defaults.update(set_grad_none=set_grad_none)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients: to ``None`` when ``set_grad_none`` (DeepSpeed's behaviour), else to zeros."""
        super().zero_grad(set_to_none=self.set_grad_none)

"""``deepspeed.ops.adam``: ``FusedAdam`` and ``DeepSpeedCPUAdam`` as torch's Adam with DeepSpeed's signatures.

DeepSpeed's two Adam optimizers are compiled kernels (a multi-tensor CUDA kernel, an AVX CPU loop) of the same
update; hybridzero has no compiled ops, so both names are :class:`torch.optim.Adam` subclasses that keep DeepSpeed's
constructor signature and defaults and compute the same update:

* ``adam_w_mode`` (``FusedAdam``) / ``adamw_mode`` (``DeepSpeedCPUAdam``), default True: decoupled weight decay
  (``p -= lr * weight_decay * p``, AdamW); False: L2 regularization added to the gradient (classic Adam). Mapped to
  torch's ``decoupled_weight_decay``.
* ``bias_correction`` must be True (torch's Adam always corrects; False is refused by name).
* ``amsgrad`` is refused by both, as DeepSpeed refuses it.
* ``FusedAdam.zero_grad`` sets gradients to ``None`` when ``set_grad_none`` (DeepSpeed's default True).
* ``DeepSpeedCPUAdam(fp32_optimizer_states=True)`` keeps fp32 state; False (state in the parameter's dtype) is
  refused by name, since torch keeps state in the parameter's dtype and hybridzero's masters are fp32 anyway.

Each class records its DeepSpeed-only arguments in ``defaults`` so ``cls(params, **defaults)`` rebuilds the same
optimizer (what :func:`hybridzero.initialize` does with a client optimizer).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from hybridzero.ops.states import require_fp32_states

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]

Params = Iterable[torch.Tensor] | Iterable[dict[str, Any]]


def _check(name: str, bias_correction: bool, amsgrad: bool) -> None:
    """Refuse the DeepSpeed options torch's Adam cannot honour, naming the option."""
    if not bias_correction:
        raise ValueError(f"{name}(bias_correction=False) is not supported: torch's Adam always corrects the bias")
    if amsgrad:
        raise RuntimeError(f"{name} does not support the AMSGrad variant (amsgrad=True), as in DeepSpeed")


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's ``FusedAdam(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
    adam_w_mode=True, weight_decay=0.0, amsgrad=False, set_grad_none=True)`` (see the module docstring)."""

    def __init__(
        self,
        params: Params,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        _check("FusedAdam", bias_correction, amsgrad)
        super().__init__(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, decoupled_weight_decay=adam_w_mode
        )
        self.adam_w_mode = adam_w_mode
        self.set_grad_none = set_grad_none
        self.defaults.update(bias_correction=True, adam_w_mode=adam_w_mode, set_grad_none=set_grad_none)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients: to ``None`` when ``set_grad_none`` (DeepSpeed's behaviour), else to zeros."""
        super().zero_grad(set_to_none=self.set_grad_none)


class DeepSpeedCPUAdam(torch.optim.Adam):
    """DeepSpeed's ``DeepSpeedCPUAdam(model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
    weight_decay=0, amsgrad=False, adamw_mode=True, fp32_optimizer_states=True)`` (see the module docstring)."""

    def __init__(
        self,
        model_params: Params,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None:
        _check("DeepSpeedCPUAdam", bias_correction, amsgrad)
        require_fp32_states("DeepSpeedCPUAdam", fp32_optimizer_states)
        super().__init__(
            model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, decoupled_weight_decay=adamw_mode
        )
        self.adam_w_mode = adamw_mode
        self.defaults.update(bias_correction=True, adamw_mode=adamw_mode, fp32_optimizer_states=True)

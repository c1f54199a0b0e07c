"""``deepspeed.ops.adagrad``: ``DeepSpeedCPUAdagrad`` as :class:`torch.optim.Adagrad` with DeepSpeed's signature.

DeepSpeed's class is a compiled AVX loop of torch's Adagrad update with torch's defaults (``lr=1e-2``, ``eps=1e-10``,
``weight_decay=0`` added to the gradient, no learning-rate decay, a zero initial accumulator); hybridzero has no
compiled ops, so it is torch's own class. ``amsgrad`` (accepted and unused by DeepSpeed's class) is refused when
true, naming it; ``fp32_optimizer_states=False`` is refused by name (the state follows the fp32 masters). The
DeepSpeed-only arguments are recorded in ``defaults`` so ``cls(params, **defaults)`` rebuilds the same optimizer.

Accelerate maps a torch ``Adagrad`` to this class when the config offloads the optimizer, passing the
``adamw_mode=False`` it passes to every DeepSpeed CPU optimizer; DeepSpeed's own class has no such argument and
raises ``TypeError`` there, so that path never worked with DeepSpeed. It is accepted here (``False`` is Adagrad's
own weight decay; ``True`` is refused by name).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from hybridzero.ops.states import require_fp32_states

__all__ = ["DeepSpeedCPUAdagrad"]

Params = Iterable[torch.Tensor] | Iterable[dict[str, Any]]


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    """DeepSpeed's ``DeepSpeedCPUAdagrad(model_params, lr=1e-2, eps=1e-10, weight_decay=0, amsgrad=False,
    fp32_optimizer_states=True)`` (see the module docstring)."""

    def __init__(
        self,
        model_params: Params,
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        fp32_optimizer_states: bool = True,
        adamw_mode: bool = False,
    ) -> None:
        if adamw_mode:
            raise ValueError(
                "DeepSpeedCPUAdagrad(adamw_mode=True) is not supported: Adagrad adds weight decay to the gradient"
            )
        if amsgrad:
            raise ValueError("DeepSpeedCPUAdagrad(amsgrad=True) is not supported: Adagrad has no AMSGrad variant")
        require_fp32_states("DeepSpeedCPUAdagrad", fp32_optimizer_states)
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)
        self.defaults.update(amsgrad=False, fp32_optimizer_states=True)

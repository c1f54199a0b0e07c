"""Per-rank body: a model whose blocks are sibling submodules of one class (no ``ModuleList``), the shape of
DeepSpeed's ZeRO-3 partitioning tests, driven through DeepSpeed's names: each block fetched for its own forward only,
``ds_tensor.data = ...`` writing this rank's part, ``get_fp32_grad_partitions()`` per optimizer param group (padding
included), accumulation over ``backward`` calls, ``optimizer.zero_grad()`` and ``optimizer.step()``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

SHAPE = (5, 7)  # 35 elements: divisible by none of 2, 3, 4
NAMES = ("first", "second", "third")


class Scale(nn.Module):
    """``weight * x``; records its own parameter's status while it runs."""

    def __init__(self, log: list[tuple[str, str, str]], name: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(SHAPE))
        self.log, self.name = log, name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append(("inside", self.name, self.weight.ds_status.name))
        return self.weight * x


class Siblings(nn.Module):
    """Three ``Scale`` blocks registered one by one; records every block's status around each block's call."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, str, str]] = []
        self.first, self.second, self.third = (Scale(self.log, n) for n in NAMES)

    def _note(self, when: str) -> None:
        for n in NAMES:
            self.log.append((when, n, getattr(self, n).weight.ds_status.name))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._note("start")
        for n in NAMES:
            x = getattr(self, n)(x)
            self._note(f"after {n}")
        return (x - 1).abs().sum()


def run(lr: float, prefetch: bool = False) -> dict[str, Any]:
    """Write rank-dependent parts through ``ds_tensor``, then forward/backward twice (no step), read the gradient
    parts, ``zero_grad``, one more backward, ``optimizer.step()`` and read the full fp32 parameters. ``prefetch``:
    a prefetch bucket holding the whole model (DeepSpeed's test_prefetching), else no prefetch."""
    from hybridzero.deepspeed_alias import install, uninstall

    assert install()  # DeepSpeed's names, as its tests use them
    try:
        return _body(lr, prefetch)
    finally:
        uninstall()


def _body(lr: float, prefetch: bool) -> dict[str, Any]:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    deepspeed.init_distributed(dist_backend="gloo")
    rank = deepspeed.comm.get_rank()
    model = Siblings()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "Adam", "params": {"lr": lr, "weight_decay": 0.0}},
        "zero_optimization": {  # no reuse distance across forward and backward
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 3 * SHAPE[0] * SHAPE[1] if prefetch else 0,
            "stage3_max_reuse_distance": 0,
        },
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    weights = [getattr(model, n).weight for n in NAMES]
    sizes = [w.ds_tensor.numel() for w in weights]
    for i, w in enumerate(weights):
        w.ds_tensor.data = torch.full_like(w.ds_tensor.data, float((i + 1) * (rank + 1)))
    x = torch.linspace(-1.0, 1.0, SHAPE[0] * SHAPE[1]).reshape(SHAPE)
    losses, logs = [], []
    for _ in range(2):
        model.log.clear()
        loss = engine(x)
        logs.append(list(model.log))
        engine.backward(loss)
        losses.append(float(loss.detach()))
    opt = engine.optimizer
    parts = opt.get_fp32_grad_partitions()
    twice = {NAMES[i]: parts[0][i].clone() for i in range(len(NAMES))}
    opt.zero_grad()
    zeroed = all(not t.any() for t in opt.get_fp32_grad_partitions()[0].values())
    engine.backward(engine(x))
    opt.step()
    full = {n: safe_get_full_fp32_param(w).clone() for n, w in zip(NAMES, weights)}
    return {
        "rank": rank,
        "sizes": sizes,
        "logs": logs,
        "groups": sorted(parts),
        "twice": twice,
        "zeroed": zeroed,
        "losses": losses,
        "full": full,
        "norm": engine.get_global_grad_norm(),
        "global_steps": engine.global_steps,
    }

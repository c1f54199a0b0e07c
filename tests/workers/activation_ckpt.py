"""Per-rank body: a ZeRO-3 engine over blocks run through ``deepspeed.checkpointing.checkpoint`` (Megatron-style
model code), or plainly; dropout draws from the Megatron RNG tracker's model-parallel stream."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(9, 9)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import deepspeed

        with deepspeed.checkpointing.get_cuda_rng_tracker().fork():
            return x + torch.nn.functional.dropout(torch.tanh(self.fc(x)), 0.25)


class _Model(nn.Module):
    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.embed = nn.Linear(9, 9)  # the blocks' input requires grad, as a reentrant checkpoint needs
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.head = nn.Linear(9, 5)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import deepspeed

        x = self.embed(x)
        for block in self.blocks:
            x = deepspeed.checkpointing.checkpoint(block, x) if self.checkpointed else block(x)
        return self.head(x).square().mean()


def run(checkpointed: bool) -> dict[str, Any]:
    """Three steps at ZeRO-3; the losses and the full parameters."""
    from hybridzero.deepspeed_alias import install, uninstall

    assert install()
    try:
        return _body(checkpointed)
    finally:
        uninstall()


def _body(checkpointed: bool) -> dict[str, Any]:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank = deepspeed.comm.get_rank()
    deepspeed.checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {"profile": False}})
    torch.manual_seed(0)
    model = _Model(checkpointed)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = deepspeed.initialize(model=model, config=config)
    deepspeed.checkpointing.model_parallel_cuda_manual_seed(100 + rank)
    data = torch.randn(3, 4, 9, generator=torch.Generator().manual_seed(rank))
    losses = []
    for step in range(3):
        loss = engine(data[step])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = engine.full_parameters()
    engine.destroy()
    return {"losses": losses, "params": params}

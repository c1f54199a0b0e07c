"""Per-rank body for a model whose blocks are an ``nn.Sequential`` stack (timm-style, no ``nn.ModuleList``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

DIM, HIDDEN, OUT, DEPTH, BATCH, STEPS = 7, 13, 5, 3, 3, 3


class StackBlock(nn.Module):
    """A residual MLP block (numels 7*13+13, 13*7+7: not divisible by 2, 3 or 4 together)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Stack(nn.Module):
    """Embedding projection, ``nn.Sequential(*blocks)``, a mixed ``nn.Sequential`` head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.blocks = nn.Sequential(*[StackBlock() for _ in range(DEPTH)])
        self.head = nn.Sequential(nn.Linear(DIM, OUT), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)))


def stack_data(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[STEPS, world * BATCH, DIM]`` inputs and ``[STEPS, world * BATCH, OUT]`` targets (rank r takes rows
    ``r * BATCH .. (r + 1) * BATCH`` of each step)."""
    g = torch.Generator().manual_seed(5)
    return torch.randn(STEPS, world * BATCH, DIM, generator=g), torch.randn(STEPS, world * BATCH, OUT, generator=g)


def build_stack() -> Stack:
    torch.manual_seed(0)
    return Stack()


def stack_run() -> dict[str, Any]:
    """ZeRO-3 on :class:`Stack`: the group names, the all-gathers of the first forward, the peak of gathered bytes,
    the per-step mean losses over this rank's rows, and the final full parameters."""
    import hybridzero

    hybridzero.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    cfg = {
        "train_micro_batch_size_per_gpu": BATCH,
        "zero_optimization": {  # no prefetch, nothing kept from forward to backward: one block whole at a time
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 0,
            "stage3_max_reuse_distance": 0,
        },
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
    }
    engine, *_ = hybridzero.initialize(model=build_stack(), config=cfg)
    xs, ys = stack_data(world)
    rows = slice(rank * BATCH, (rank + 1) * BATCH)
    losses, gathers = [], -1
    for step in range(STEPS):
        mark = engine.comm_ledger().copy()
        loss = (engine(xs[step, rows]) - ys[step, rows]).square().mean()
        if step == 0:
            gathers = engine.comm_ledger().since(mark).total("all_gather", phase="forward").calls
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    out = {
        "groups": [g.name for g in engine.coordinator.groups],
        "forward_gathers": gathers,
        "peak": engine.coordinator.peak_gathered_bytes,
        "losses": losses,
        "params": engine.full_parameters(),
    }
    engine.destroy()
    return out


def stack_reference(world: int) -> dict[str, Any]:
    """The same training in one process: each rank's mean loss, their gradients averaged, Adam."""
    model = build_stack()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    xs, ys = stack_data(world)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        per_rank = []
        for r in range(world):
            rows = slice(r * BATCH, (r + 1) * BATCH)
            loss = (model(xs[step, rows]) - ys[step, rows]).square().mean()
            (loss / world).backward()
            per_rank.append(loss.item())
        opt.step()
        losses.append(per_rank)
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}

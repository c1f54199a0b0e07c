"""Per-rank bodies for models laid out unlike a Hugging Face decoder: blocks in an ``nn.Sequential`` stack (timm-style,
no ``nn.ModuleList``), and a block reading another block's weight (``register_external_parameter``)."""

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
    losses, gathers = _train_engine(engine, rank, world)
    out = {
        "groups": [g.name for g in engine.coordinator.groups],
        "forward_gathers": gathers,
        "peak": engine.coordinator.peak_gathered_bytes,
        "losses": losses,
        "params": engine.full_parameters(),
    }
    engine.destroy()
    return out


def _train_engine(engine: Any, rank: int, world: int) -> tuple[list[float], int]:
    """:data:`STEPS` steps on this rank's rows of :func:`stack_data`: the losses, and the all-gathers the first
    forward issued."""
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
    return losses, gathers


def stack_reference(world: int) -> dict[str, Any]:
    """The same training in one process: each rank's mean loss, their gradients averaged, Adam."""
    return _reference(build_stack(), world)


def _reference(model: nn.Module, world: int) -> dict[str, Any]:
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


class SharingBlock(nn.Module):
    """A block that also reads another block's weight in its forward (registered as external, as DeepSpeed asks)."""

    def __init__(self, borrowed: nn.Linear | None) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.borrowed = [borrowed]  # a plain list: not a submodule, its parameters stay the other block's
        if borrowed is not None:
            from hybridzero.zero import register_external_parameter

            register_external_parameter(self, borrowed.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.fc(x))
        other = self.borrowed[0]
        return y if other is None else y + x @ other.weight.t() * 0.5


class Sharing(nn.Module):
    """Two blocks in an ``nn.ModuleList``; block 1 uses block 0's ``fc.weight`` (external to block 1)."""

    def __init__(self) -> None:
        super().__init__()
        first = SharingBlock(None)
        self.layers = nn.ModuleList([first, SharingBlock(first.fc), SharingBlock(None)])
        self.head = nn.Linear(DIM, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build_sharing() -> Sharing:
    torch.manual_seed(0)
    return Sharing()


def sharing_run() -> dict[str, Any]:
    """ZeRO-3 on :class:`Sharing`: the groups' parameter names, the losses, the final parameters, and what
    registering after ``initialize`` does (a root parameter: nothing; a block's: an error naming it)."""
    import hybridzero
    from hybridzero.zero import register_external_parameter

    hybridzero.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    cfg = {
        "train_micro_batch_size_per_gpu": BATCH,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
    }
    model = build_sharing()
    engine, *_ = hybridzero.initialize(model=model, config=cfg)
    losses, _ = _train_engine(engine, rank, world)
    register_external_parameter(model.layers[2], model.layers[0].fc.weight)  # in the root group: a no-op
    try:
        register_external_parameter(model.layers[2], model.layers[1].fc.weight)
        late = "accepted"
    except RuntimeError as exc:
        late = str(exc)
    out = {
        "groups": {g.name: [s.spec.name for s in g.slots] for g in engine.coordinator.groups},
        "losses": losses,
        "late": late,
        "params": engine.full_parameters(),
    }
    engine.destroy()
    return out


def sharing_reference(world: int) -> dict[str, Any]:
    """:class:`Sharing` trained in one process as :func:`stack_reference` trains :class:`Stack`."""
    return _reference(build_sharing(), world)

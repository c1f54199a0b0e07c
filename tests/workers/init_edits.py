"""Per-rank body: an edit inside ``GatheredParameters`` without a modifier rank on parameters that ``zero.Init``
partitioned (no engine yet)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def init_edit_without_modifier(editors: tuple[int, ...]) -> dict[str, Any]:
    """Ranks in ``editors`` add 1 to a ``zero.Init`` weight inside ``GatheredParameters`` without a modifier rank;
    report whether this rank raised (and the message), whether the value is the one from before the block, and
    whether a block without an edit raises nothing."""
    import hybridzero

    hybridzero.init_distributed()
    rank = torch.distributed.get_rank()
    with hybridzero.zero.Init(config_dict_or_path={"train_batch_size": 2, "zero_optimization": {"stage": 3}}):
        model = nn.Linear(5, 3)  # 15 elements: uneven over two ranks
    with hybridzero.zero.GatheredParameters([model.weight]):
        before = model.weight.detach().clone()
    message = None
    try:
        with hybridzero.zero.GatheredParameters([model.weight, model.bias]), torch.no_grad():
            if rank in editors:
                model.weight.add_(1.0 if rank == 0 else 0.0)  # adding 0 is an in-place modification too
    except RuntimeError as exc:
        message = str(exc)
    with hybridzero.zero.GatheredParameters([model.weight]):
        kept = torch.equal(model.weight, before)
    quiet = True
    try:
        with hybridzero.zero.GatheredParameters([model.weight]):
            _ = model.weight.sum()
    except RuntimeError:
        quiet = False
    return {"message": message, "kept": kept, "quiet": quiet}

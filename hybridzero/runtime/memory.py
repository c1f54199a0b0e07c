"""Per-rank memory accounting of model states (what ZeRO partitions) and live gathered buffers.

Invariant: each storage is counted once (the fp32 master doubles as the parameter shard in fp32 training and as
the bound buffer of whole fp32 groups). ``model_states`` = parameters + master weights + gradients + optimizer
state; ``gathered`` is transient (zero when the engine is quiescent, except pinned ``GatheredParameters``).
``placement`` says where each category lives between steps -- ``device``, ``host`` (ZeRO-Offload) or ``file``
(optimizer state swapped to NVMe; its in-memory bytes are then 0 between steps) -- with its bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from hybridzero.zero.groups import GroupState, ShardedGroup
from hybridzero.zero.offload import Placement


def _nbytes(tensors: Iterable[torch.Tensor | None], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        key = t.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def memory_report(
    groups: Sequence[ShardedGroup],
    optimizer: torch.optim.Optimizer | None,
    placement: Placement | None = None,
    file_bytes: int = 0,
) -> dict[str, Any]:
    """Bytes per category on this rank (see module docstring); ``persisted`` is the share of the persistent group;
    ``file_bytes`` are the optimizer state bytes in swap files."""
    seen: set[int] = set()
    master = _nbytes((g.master for g in groups), seen)
    params = _nbytes((g.full for g in groups if g.always_full), seen)
    gathered = _nbytes((g.full for g in groups if not g.always_full and g.state is not GroupState.SHARDED), seen)
    grads = _nbytes([g.grad_shard for g in groups] + [g.opt_grad for g in groups] + [g.grad_full for g in groups], seen)
    state = 0
    if optimizer is not None:
        state = _nbytes(
            (t for st in optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor) and t.dim() > 0),
            seen,
        )
    persisted = sum(g.layout.padded_numel for g in groups if g.replicated)
    sizes = {
        "parameters": params,
        "master_weights": master,
        "gradients": grads,
        "optimizer_state": state,
        "gathered": gathered,
    }
    where: dict[str, dict[str, int]] = {"device": {}, "host": {}, "file": {}}
    for category, nbytes in sizes.items():
        place = placement.where(category) if placement is not None else "device"
        where["host" if place == "file" else place][category] = nbytes  # resident part (inside a step, a save)
    if placement is not None and placement.state_in_files:
        where["file"]["optimizer_state"] = file_bytes
    return {
        "placement": where,
        "optimizer_state_file": file_bytes,
        "parameters": params,
        "master_weights": master,
        "gradients": grads,
        "optimizer_state": state,
        "model_states": params + master + grads + state,
        "gathered": gathered,
        "persisted_numel": persisted,
    }

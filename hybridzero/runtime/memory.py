"""Per-rank memory accounting of model states (what ZeRO partitions) and live gathered buffers.

Invariant: each storage is counted once (the fp32 master doubles as the parameter shard in fp32 training and as
the bound buffer of whole fp32 groups). ``model_states`` = parameters + master weights + gradients + optimizer
state; ``gathered`` is transient (zero when the engine is quiescent, except pinned ``GatheredParameters``).
``placement`` says where each category lives between steps -- ``device``, ``host`` (ZeRO-Offload) or ``file``
(NVMe: optimizer state, the sharded groups' fp32 masters and, with ``offload_param: nvme``, the compute shards;
their in-memory bytes are then 0 between steps) -- with its bytes. With the master in a file the kept compute shards
count as ``parameters`` where they live (device, or host with ``offload_param: cpu``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from hybridzero.optim.swap import StateSwapper
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


def _resident(placement: Placement | None, category: str) -> str:
    """Where the in-memory part of ``category`` is: its placement, with "file" categories' buffers on the host."""
    place = placement.where(category) if placement is not None else "device"
    return "host" if place == "file" else place


def memory_report(
    groups: Sequence[ShardedGroup],
    optimizer: torch.optim.Optimizer | None,
    placement: Placement | None = None,
    swapper: StateSwapper | None = None,
) -> dict[str, Any]:
    """Bytes per category on this rank (see module docstring); ``persisted`` is the share of the persistent group;
    with NVMe offload the bytes held in the swap files are reported under ``placement["file"]`` and ``*_file``."""
    seen: set[int] = set()
    master = _nbytes((g.master for g in groups), seen)
    params = _nbytes((g.full for g in groups if g.always_full), seen)
    kept = _nbytes((g.compute for g in groups), seen)  # compute shards kept while the master is in a file
    gathered = _nbytes((g.full for g in groups if not g.always_full and g.state is not GroupState.SHARDED), seen)
    grads = _nbytes([g.grad_shard for g in groups] + [g.opt_grad for g in groups] + [g.grad_full for g in groups], seen)
    state = 0
    if optimizer is not None:
        state = _nbytes(
            (t for st in optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor) and t.dim() > 0),
            seen,
        )
    persisted = sum(g.layout.padded_numel for g in groups if g.replicated)
    where: dict[str, dict[str, int]] = {"device": {}, "host": {}, "file": {}}

    def add(place: str, category: str, nbytes: int) -> None:
        where[place][category] = where[place].get(category, 0) + nbytes

    for category, nbytes in (
        ("parameters", params),
        ("master_weights", master),
        ("gradients", grads),
        ("optimizer_state", state),
        ("gathered", gathered),
    ):
        add(_resident(placement, category), category, nbytes)
    if kept:
        add(_resident(placement, "compute_shards"), "parameters", kept)
    files = {"optimizer_state": 0, "master_weights": 0, "parameters": 0}
    if swapper is not None:
        files["optimizer_state"] = swapper.file_bytes()
        if swapper.masters is not None:
            files["master_weights"], files["parameters"] = swapper.masters.file_bytes()
    for category, nbytes in files.items():
        if nbytes or (category == "optimizer_state" and placement is not None and placement.state_in_files):
            add("file", category, nbytes)
    return {
        "placement": where,
        "optimizer_state_file": files["optimizer_state"],
        "master_weights_file": files["master_weights"],
        "parameters_file": files["parameters"],
        "parameters": params + kept,
        "master_weights": master,
        "gradients": grads,
        "optimizer_state": state,
        "model_states": params + kept + master + grads + state,
        "gathered": gathered,
        "persisted_numel": persisted,
    }

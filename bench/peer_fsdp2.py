"""One PyTorch FSDP2 rank of ``bench/bench_peers.py`` (run under ``torch.distributed.run``, CPU, gloo).

``torch.distributed.fsdp.fully_shard`` is applied to every decoder layer and then to the root (the embedding,
final norm and ``lm_head`` form the root's group), on a 1-D CPU device mesh. Same AdamW hyperparameters and
gradient clipping (``clip_grad_norm_`` over the DTensor gradients) as the other systems. bf16 uses
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` over fp32 master weights.

FSDP2 has no comms ledger, so the collectives are counted by :class:`C10dCounter`, a dispatch mode that sees the
``c10d`` and ``_c10d_functional`` ops, during the last warm-up step only (it slows every op it sees, so never during
a timed step); the same counts are reported for every measured step, which FSDP2 repeats identically. Not counted:
the scalar all-reduce of the gradient norm, which DTensor issues where the dispatch mode does not see it (a few
bytes per step). Bytes are whole buffers: the gathered output of an all-gather, the unreduced input of a
reduce-scatter, the buffer of an all-reduce.

Writes ``<out-dir>/fsdp2_rank<R>.json`` (see :mod:`peer_common`).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from peer_common import (
    adamw_settings,
    build_model,
    rank_batches,
    worker_parser,
    write_result,
)
from torch.utils._python_dispatch import TorchDispatchMode

_WHOLE_BUFFER_ARG: dict[str, int] = {
    "_allgather_base_": 0,
    "allgather_into_tensor_coalesced_": 0,
    "_reduce_scatter_base_": 1,
    "reduce_scatter_tensor_coalesced_": 1,
}
"""Index of the whole-buffer argument of c10d ops whose first argument is not it (default: argument 0)."""


def _tensor_bytes(value: Any) -> int:
    """Bytes of a tensor or of every tensor in a (nested) list; 0 for anything else."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


class C10dCounter(TorchDispatchMode):
    """Counts calls and whole-buffer bytes of every ``c10d`` collective dispatched while it is active."""

    def __init__(self) -> None:
        """An empty counter; ``totals`` maps op name to ``{"calls": n, "bytes": n}``."""
        super().__init__()
        self.totals: dict[str, dict[str, int]] = {}

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        """Record ``func`` if it is a collective, then run it unchanged."""
        name = func._opname
        if func.namespace in ("c10d", "_c10d_functional") and args and name != "wait_tensor":
            index = _WHOLE_BUFFER_ARG.get(name, 0)
            nbytes = _tensor_bytes(args[index]) if index < len(args) else 0
            if func.namespace == "_c10d_functional" and name.startswith("all_gather"):
                nbytes *= int(args[1])  # functional all-gather: (input shard, group_size, group_name)
            entry = self.totals.setdefault(name, {"calls": 0, "bytes": 0})
            entry["calls"] += 1
            entry["bytes"] += nbytes
        return func(*args, **(kwargs or {}))


def shard_model(model: torch.nn.Module, world: int, dtype: str, hpz: int = 1) -> None:
    """``fully_shard`` each decoder layer, then the root, on a CPU mesh of ``world`` ranks.

    ``hpz > 1``: the layers reshard after forward to groups of ``hpz`` ranks (``reshard_after_forward=hpz``), FSDP2's
    counterpart of ZeRO++ hpZ (backward gathers within the group).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if dtype == "bf16" else None, reduce_dtype=torch.float32 if dtype == "bf16" else None
    )
    reshard: bool | int = hpz if hpz > 1 else True
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def train_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor, clipping: float, counter: C10dCounter | None
) -> dict[str, Any]:
    """Forward, backward, clip, AdamW, zero_grad; timed like ``bench_model.measured_step``."""
    start = time.perf_counter()
    if counter is not None:
        with counter:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clipping)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    else:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clipping)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    opt.step()
    opt.zero_grad(set_to_none=True)
    step_ms = (time.perf_counter() - start) * 1e3
    return {"loss": float(loss.detach().float().item()), "step_ms": step_ms, "grad_norm": float(norm)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train this rank with FSDP2; the per-step records (warm-up included)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(args.seed, args.model)
    vocab, n_params = int(model.config.vocab_size), sum(p.numel() for p in model.parameters())
    shard_model(model, world, args.dtype, args.hpz)
    adamw, clipping = adamw_settings(world)
    opt = torch.optim.AdamW(model.parameters(), **adamw)
    batches = rank_batches(args, world, vocab)
    counter = C10dCounter()
    records = []
    for step in range(args.warmup + args.steps):
        counting = step == max(args.warmup - 1, 0) and not counter.totals
        records.append(train_step(model, opt, batches[step, rank], clipping, counter if counting else None))
    for record in records[args.warmup :]:
        record["collectives"] = counter.totals
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": rank, "world_size": world, "n_params": n_params, "steps": records}


def main(argv: list[str] | None = None) -> int:
    """Run one FSDP2 rank and write its JSON file."""
    args = worker_parser(__doc__.splitlines()[0]).parse_args(argv)
    torch.set_num_threads(1)
    write_result(args, "fsdp2", run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

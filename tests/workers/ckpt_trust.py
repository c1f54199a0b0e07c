"""Per-rank functions for the checkpoint trust-boundary tests: snapshots of everything a load may change, loads
expected to fail, hostile saves, killed saves, odd optimizer state, 16-bit export."""

from __future__ import annotations

import os
import pickle
import random
from pathlib import Path
from typing import Any

import torch

import hybridzero
from hybridzero.checkpoint import CheckpointError, writer
from hybridzero.runtime.optim_state import leaf_ranges
from hybridzero.zero.partition import param_aliases
from tests.harness.parity import RunSpec, batches_for, build_model, ds_config
from tests.workers.ckpt import _engine, _train


class Payload:
    """A pickle that creates ``marker`` when unpickled (what an attacker's ``__reduce__`` would do)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (self.marker, "w"))


def payload_bytes(marker: str) -> bytes:
    """The crafted pickle, as ``torch.save`` of a dict holding it would also write it."""
    return pickle.dumps({"state": Payload(marker)})


def snapshot(engine: Any) -> dict[str, Any]:
    """Everything a load may write, on this rank (local copies; no collective)."""
    opt = engine.optimizer
    state = (
        []
        if opt is None
        else [
            {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state.get(leaf, {}).items()}
            for _, leaf, _, _, _ in leaf_ranges(opt, engine.groups)
        ]
    )
    return {
        "masters": [g.master.clone() for g in engine.groups],
        "compute": [g.compute_shard().clone() for g in engine.groups],
        "opt": state,
        "hyper": [] if opt is None else [dict(g, params=None) for g in opt.param_groups],
        "counters": (engine.global_steps, engine.micro_steps, engine.skipped_steps),
        "torch_rng": torch.get_rng_state(),
        "py_rng": random.getstate(),
        "sched": None if engine.lr_scheduler is None else engine.lr_scheduler.state_dict(),
        "scaler": engine.loss_scaler.state_dict(),
    }


def same(a: Any, b: Any) -> bool:
    """Bitwise equality of nested snapshots (tensor dtype and shape included)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def trained(spec: RunSpec, steps: int = 1) -> tuple[Any, torch.Tensor, int]:
    """An engine after ``steps`` training steps (so it has optimizer state, counters and a moved RNG)."""
    engine, batches, rank = _engine(spec)
    _train(engine, batches, rank, range(steps), spec.accumulation)
    random.random()
    torch.rand(3)
    return engine, batches, rank


def failing_load(
    spec: RunSpec, ckpt: str, tag: str | None = None, per_rank_dir: list[str] | None = None, good: str | None = None
) -> dict[str, Any]:
    """Load that must fail: the error text, whether every piece of engine state is bitwise unchanged, and whether
    the engine still trains and loads the ``good`` checkpoint afterwards (no posted failure, no hang)."""
    engine, batches, rank = trained(spec, 2)
    before = snapshot(engine)
    where = per_rank_dir[rank] if per_rank_dir is not None else ckpt
    try:
        engine.load_checkpoint(where, tag)
        error = "loaded"
    except CheckpointError as exc:
        error = f"CheckpointError: {exc}"
    unchanged = same(before, snapshot(engine))
    _train(engine, batches, rank, range(2, 3), spec.accumulation)
    recovered = engine.load_checkpoint(good)[0] is not None if good is not None else None
    return {"error": error, "unchanged": unchanged, "recovered": recovered}


def hostile_save(spec: RunSpec, root: str, tag: str, client_state: Any = None) -> str:
    """A save that must be refused: the error text (or 'saved')."""
    engine, _, _ = trained(spec)
    try:
        engine.save_checkpoint(root, tag=tag, client_state=client_state)
        return "saved"
    except CheckpointError as exc:
        return f"CheckpointError: {exc}"


def save_tag(spec: RunSpec, root: str, tag: str | None = None, steps: int = 1) -> dict[str, Any]:
    """Train ``steps`` steps and save; the parameters saved (rank 0) and the verified tag path."""
    engine, _, rank = trained(spec, steps)
    engine.save_checkpoint(root, tag=tag)
    params = engine.full_parameters()
    return {"params": params if rank == 0 else None}


def killed_save(spec: RunSpec, root: str, point: str) -> None:
    """Save ``tag1``, train, then die at ``point`` of saving ``tag2`` (or of re-saving ``tag1``)."""
    engine, batches, rank = trained(spec)
    engine.save_checkpoint(root, tag="tag1")
    _train(engine, batches, rank, range(1, 2), spec.accumulation)
    calls = {"n": 0}
    real_replace, real_save_file = os.replace, writer.save_file

    def die_at_replace(n: int) -> Any:
        def replace(*args: Any) -> None:
            calls["n"] += 1
            if calls["n"] == n:
                os._exit(17)
            real_replace(*args)

        return replace

    def half_written(tensors: dict[str, torch.Tensor], path: str, **kwargs: Any) -> None:
        real_save_file(tensors, path, **kwargs)
        data = Path(path).read_bytes()
        Path(path).write_bytes(data[: len(data) // 2])
        os._exit(17)

    tag = "tag2"
    if point == "rank_file" and rank == 1:
        writer.save_file = half_written  # only in this doomed worker process
    elif point in ("publish", "latest") and rank == 0:
        os.replace = die_at_replace(1 if point == "publish" else 2)
    elif point.startswith("resave") and rank == 0:
        tag = "tag1"
        os.replace = die_at_replace(1 if point == "resave_aside" else 2)
    elif point == "resave_aside" or point == "resave_publish":
        tag = "tag1"
    engine.save_checkpoint(root, tag=tag)


def load_params(spec: RunSpec, root: str, tag: str | None = None) -> dict[str, Any]:
    """Load (must succeed) and return the path and the parameters (rank 0)."""
    engine, _, rank = _engine(spec)
    path, _ = engine.load_checkpoint(root, tag)
    params = engine.full_parameters()
    return {"path": path, "params": params if rank == 0 else None}


class OddStateSGD(torch.optim.Optimizer):
    """Momentum SGD whose state has every awkward kind: a shape-[1] float ``step``, a 0-dim int64 ``count``, a
    multi-element ``hist`` that is not per-element, and a per-element ``buf``."""

    def __init__(self, params: Any, lr: float = 0.05) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = torch.zeros(1)
                    st["count"] = torch.zeros((), dtype=torch.int64)
                    st["hist"] = torch.zeros(5, dtype=torch.float64)
                    st["buf"] = torch.zeros_like(p)
                st["step"] += 1
                st["count"] += 2
                st["hist"] = torch.roll(st["hist"], 1)
                st["hist"][0] = float(st["step"][0]) / 3
                st["buf"].mul_(0.9).add_(p.grad)
                p.add_(st["buf"], alpha=-group["lr"])


def odd_state_round_trip(spec: RunSpec, root: str) -> dict[str, Any]:
    """Train with :class:`OddStateSGD`, save, load into a fresh engine: per-leaf state equal in shape, dtype and
    value; one more step on each gives the same parameters."""
    hybridzero.init_distributed()
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()

    def make() -> Any:
        model = build_model(spec)
        engine, *_ = hybridzero.initialize(
            model=model, config=ds_config(spec, world), optimizer=OddStateSGD(model.parameters())
        )
        return engine

    batches = batches_for(spec, world, int(build_model(spec).config.vocab_size))
    first = make()
    _train(first, batches, rank, range(2), spec.accumulation)
    first.save_checkpoint(root)
    second = make()
    second.load_checkpoint(root)
    a = snapshot(first)["opt"]
    b = snapshot(second)["opt"]
    kinds = sorted({(k, str(v.dtype), tuple(v.shape)) for st in b for k, v in st.items() if k != "buf"})
    _train(first, batches, rank, range(2, 3), spec.accumulation)
    _train(second, batches, rank, range(2, 3), spec.accumulation)
    return {
        "state_equal": same(a, b),
        "kinds": kinds,
        "n_leaves": len(a),
        "params_equal": same(first.full_parameters(), second.full_parameters()),
    }


def save_16bit(spec: RunSpec, out: str, name: str, gather: bool) -> dict[str, Any]:
    """``save_16bit_model`` with ``stage3_gather_16bit_weights_on_model_save=gather``: return value, and on rank 0
    the engine's full parameters in the compute dtype by every name."""
    spec = spec.replace(extra_zero={"stage3_gather_16bit_weights_on_model_save": gather})
    engine, _, rank = trained(spec)
    result = engine.save_16bit_model(out, name)
    full = engine.full_parameters()
    names = {n: full[first].to(engine.compute_dtype) for first, ns in param_aliases(engine.module).items() for n in ns}
    return {"result": result, "expected": names if rank == 0 else None}


def deepspeed_load_options(spec: RunSpec, root: str, exclude_frozen: bool) -> dict[str, Any]:
    """Save after two steps (optionally without frozen parameters); load into engines that trained one step with
    DeepSpeed's options. What each load replaced (params / optimizer state / counters) versus kept."""
    engine, _, rank = trained(spec, 2)
    engine.save_checkpoint(root, tag="a", client_state={"epoch": 3}, exclude_frozen_parameters=exclude_frozen)
    saved = {"params": engine.full_parameters(), "opt": snapshot(engine)["opt"]}
    out: dict[str, Any] = {}
    for label, kwargs in {
        "module_only": {"load_module_only": True},
        "no_optimizer": {"load_optimizer_states": False, "load_lr_scheduler_states": False},
        "full": {},
    }.items():
        fresh, _, _ = trained(spec, 1)
        before = snapshot(fresh)
        path, client = fresh.load_checkpoint(root, "a", **kwargs)
        after = snapshot(fresh)
        out[label] = {
            "path_name": Path(path).name,
            "client": client,
            "params_loaded": same(fresh.full_parameters(), saved["params"]),
            "opt_kept": same(after["opt"], before["opt"]),
            "opt_loaded": same(after["opt"], saved["opt"]),
            "sched_kept": same(after["sched"], before["sched"]),
            "counters": after["counters"],
        }
    return out


def from_pretrained_error(path: str) -> str:
    """``hybridzero.from_pretrained`` of a damaged HF directory: the error text (or 'loaded')."""
    hybridzero.init_distributed()
    cfg = ds_config(RunSpec(stage=3), torch.distributed.get_world_size())
    try:
        hybridzero.from_pretrained(path, cfg)
        return "loaded"
    except ValueError as exc:
        return f"ValueError: {exc}"

"""Per-rank functions for the format-1 conversion tests: a trained engine's state at save time, and a fresh
engine's state after loading a converted checkpoint."""

from __future__ import annotations

from typing import Any

from tests.harness.parity import RunSpec
from tests.workers.ckpt import _engine, full_optimizer_state
from tests.workers.ckpt_trust import snapshot, trained


def save_with_snapshot(spec: RunSpec, root: str, tag: str) -> dict[str, Any]:
    """Train two steps, then save ``tag``: this rank's snapshot of everything a load restores, taken at the save,
    and (rank 0) the consolidated parameters and optimizer state."""
    engine, _, rank = trained(spec, 2)
    before = snapshot(engine)
    engine.save_checkpoint(root, tag=tag, client_state={"note": "format 1", "step": engine.global_steps})
    params, state = engine.full_parameters(), full_optimizer_state(engine)
    return {"snap": before, "params": params if rank == 0 else None, "state": state if rank == 0 else None}


def load_with_snapshot(spec: RunSpec, root: str) -> dict[str, Any]:
    """A fresh engine loads ``root``'s latest tag: the load's return value and this rank's snapshot after it."""
    engine, _, _ = _engine(spec)
    path, client = engine.load_checkpoint(root)
    return {"path": path, "client": client, "snap": snapshot(engine)}

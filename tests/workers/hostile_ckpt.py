"""Per-rank functions for the hostile checkpoint suite: many refused loads and saves on one engine per spawn (a
refused load or save changes nothing, so the engine serves every case), and a batch of ``from_pretrained`` calls."""

from __future__ import annotations

from typing import Any

import torch

import hybridzero
from tests.harness.parity import RunSpec, ds_config
from tests.workers.ckpt import _train
from tests.workers.ckpt_trust import same, snapshot, trained


def _outcome(exc: BaseException | None) -> str:
    return "ok" if exc is None else f"{type(exc).__name__}: {exc}"


def load_cases(spec: RunSpec, cases: list[tuple[str, str | None]], good: str) -> dict[str, Any]:
    """Try every ``(directory, tag)`` load on one trained engine: per case the error text (``ok`` if it loaded)
    and whether the engine stayed bitwise unchanged; then whether it still trains, loads ``good`` and steps."""
    engine, batches, rank = trained(spec, 2)
    out = []
    for where, tag in cases:
        before = snapshot(engine)
        error: BaseException | None = None
        try:
            engine.load_checkpoint(where, tag)
        except Exception as exc:  # noqa: BLE001 - the test asserts the type
            error = exc
        out.append({"error": _outcome(error), "unchanged": same(before, snapshot(engine))})
    _train(engine, batches, rank, range(2, 3), spec.accumulation)
    recovered = engine.load_checkpoint(good)[0] is not None
    _train(engine, batches, rank, range(1, 2), spec.accumulation)
    return {"cases": out, "recovered": recovered, "steps": engine.global_steps}


def save_cases(spec: RunSpec, cases: list[list[dict[str, Any]]]) -> list[str]:
    """Per case, this rank's ``save_checkpoint`` keyword arguments (``cases[i][rank]``): the error text or ``ok``."""
    engine, _, rank = trained(spec)
    out = []
    for per_rank in cases:
        kwargs = dict(per_rank[rank])
        error: BaseException | None = None
        try:
            engine.save_checkpoint(kwargs.pop("save_dir"), **kwargs)
        except Exception as exc:  # noqa: BLE001 - the test asserts the type
            error = exc
        out.append(_outcome(error))
    return out


def from_pretrained_cases(paths: list[str]) -> list[str]:
    """``hybridzero.from_pretrained`` of each directory: the error text (``ok`` if it built an engine)."""
    hybridzero.init_distributed()
    cfg = ds_config(RunSpec(stage=3), torch.distributed.get_world_size())
    out = []
    for path in paths:
        error: BaseException | None = None
        try:
            hybridzero.from_pretrained(path, cfg)
        except Exception as exc:  # noqa: BLE001 - the test asserts the type
            error = exc
        out.append(_outcome(error))
    return out


def initialize_error(config: dict[str, Any]) -> str:
    """``hybridzero.initialize`` of a tiny model with ``config``: the error text (``ok`` if it built)."""
    hybridzero.init_distributed()
    model = torch.nn.Linear(3, 5)
    try:
        hybridzero.initialize(model=model, config=config)
    except Exception as exc:  # noqa: BLE001 - the test asserts the type
        return _outcome(exc)
    return "ok"

"""``hybridzero.initialize``: DeepSpeed's entry point, same arguments, same return shape.

Invariant: every rank either returns an engine or raises; a failure on one rank during construction is agreed on
before any parameter collective (so peers raise the same error instead of hanging), and a failure after that point
fails the process group on every rank (see :func:`hybridzero.runtime.failures.failure_guard`).
"""
from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from hybridzero.checkpoint.hf_source import TensorSource
from hybridzero.comm.collectives import Comm, init_distributed
from hybridzero.comm.ledger import Ledger
from hybridzero.config import Config, load_config
from hybridzero.runtime.engine import Engine
from hybridzero.runtime.failures import failure_guard


def agree(comm: Comm, error: BaseException | None, what: str) -> None:
    """Raise on every rank if any rank has ``error`` (each peer re-raises the first failing rank's exception); an
    agreed error leaves the process group up (see :meth:`Comm.agree`)."""
    comm.agree(error, what, phase="init")


def _dataloader(data: Dataset, cfg: Config, comm: Comm, collate_fn: Callable[..., Any] | None) -> DataLoader:
    sampler = DistributedSampler(data, num_replicas=comm.world_size, rank=comm.rank, shuffle=True,
                                 seed=cfg.seed or 0, drop_last=True)
    return DataLoader(data, batch_size=cfg.train_micro_batch_size_per_gpu, sampler=sampler,
                      collate_fn=collate_fn, drop_last=True)


def initialize(model: nn.Module, config: Mapping[str, Any] | str | os.PathLike[str] | None = None, *,
               optimizer: torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None = None,
               model_parameters: Iterable[Any] | None = None, lr_scheduler: Any = None,
               training_data: Dataset | None = None, collate_fn: Callable[..., Any] | None = None,
               config_params: Mapping[str, Any] | None = None, blocks: list[str] | None = None,
               record_events: bool = False, checkpoint_source: TensorSource | None = None,
               **deepspeed_args: Any) -> tuple[Engine, Any, DataLoader | None, Any]:
    """Build a sharded engine; returns ``(engine, optimizer, dataloader, lr_scheduler)`` like DeepSpeed.

    ``config`` is a DeepSpeed JSON dict or path (``config_params`` is DeepSpeed's older alias). ``optimizer`` may be a
    client optimizer built over ``model.parameters()`` (rebuilt over the shards with the same class and
    hyperparameters) or a callable taking the parameters. ``blocks`` overrides the automatic choice of gather groups.
    A model built on the meta device is materialized group by group, from ``checkpoint_source`` (each rank reads
    only its shard) or else by the model's own init.
    DeepSpeed-only arguments (``args``, ``mpu``, ``dist_init_required``) are accepted and ignored.
    """
    unknown = set(deepspeed_args) - {"args", "mpu", "dist_init_required", "collate_fn"}
    if unknown:
        raise TypeError(f"initialize() got unexpected keyword arguments {sorted(unknown)}")
    init_distributed()
    comm = Comm(Ledger())
    cfg: Config | None = None
    error: BaseException | None = None
    try:
        source = config if config is not None else config_params
        if source is None:
            raise ValueError("initialize() needs config= (a DeepSpeed JSON dict or path)")
        cfg = load_config(source, comm.world_size)
        if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
            optimizer = optimizer(model_parameters if model_parameters is not None else model.parameters())
    except Exception as exc:  # noqa: BLE001 - agreed on below, then re-raised on every rank
        error = exc
    agree(comm, error, "initialize")
    assert cfg is not None
    comm.scope_failures(comm.all_gather_object(uuid.uuid4().hex if comm.rank == 0 else None, phase="init")[0])
    with failure_guard(comm):
        if cfg.seed is not None:
            torch.manual_seed(cfg.seed)
        engine = Engine(model, cfg, comm, optimizer=optimizer, model_parameters=model_parameters,
                        lr_scheduler=lr_scheduler, blocks=blocks, record_events=record_events,
                        source=checkpoint_source)
    loader = _dataloader(training_data, cfg, comm, collate_fn) if training_data is not None else None
    return engine, engine.optimizer, loader, engine.lr_scheduler

"""``hybridzero.initialize``: DeepSpeed's entry point, same arguments, same return shape.

Invariant: every rank either returns an engine or raises; a failure on one rank during construction is agreed on
before any parameter collective (so peers raise the same error instead of hanging), and a failure after that point
fails the process group on every rank (see :func:`hybridzero.runtime.failures.failure_guard`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from hybridzero import comm as comm_api
from hybridzero.comm.collectives import Comm
from hybridzero.comm.ledger import Ledger
from hybridzero.config import Config, load_config
from hybridzero.config.load import read_json
from hybridzero.runtime.engine import Engine
from hybridzero.runtime.failures import failure_guard
from hybridzero.runtime.sequence_parallel import check_model
from hybridzero.runtime.ulysses_hf import groups_of
from hybridzero.runtime.zero_errors import check_forced_cpu_optimizer
from hybridzero.tensor_source import TensorSource
from hybridzero.zero.init_source import init_store_of

_LOG = logging.getLogger("hybridzero")


@contextlib.contextmanager
def paused_init_contexts(model: nn.Module) -> Iterator[None]:
    """Suspend every still-entered ``zero.Init`` context holding parameters of ``model`` for the block (every rank
    calls ``initialize`` together, so the pauses line up)."""
    stores = {id(s): s for s in (init_store_of(p) for p in model.parameters()) if s is not None and s.active}
    with contextlib.ExitStack() as stack:
        for store in stores.values():
            if store.pause is not None:
                stack.enter_context(store.pause())
        yield


def agree(comm: Comm, error: BaseException | None, what: str) -> None:
    """Raise on every rank if any rank has ``error`` (each peer re-raises the first failing rank's exception); an
    agreed error leaves the process group up (see :meth:`Comm.agree`)."""
    comm.agree(error, what, phase="init")


def _dataloader(data: Dataset, cfg: Config, comm: Comm, collate_fn: Callable[..., Any] | None) -> DataLoader:
    sp = cfg.sequence_parallel_size  # the ranks of one sequence-parallel group read the same samples
    sampler: DistributedSampler[Any] = DistributedSampler(
        data, num_replicas=comm.world_size // sp, rank=comm.rank // sp, shuffle=True, seed=cfg.seed or 0, drop_last=True
    )
    return DataLoader(
        data, batch_size=cfg.train_micro_batch_size_per_gpu, sampler=sampler, collate_fn=collate_fn, drop_last=True
    )


def with_sequence_parallel(source: Any, size: int) -> dict[str, Any]:
    """The config ``source`` (mapping or JSON path) with ``sequence_parallel_size`` = ``size`` (the mpu's); a
    different value already there is an error naming both."""
    raw = dict(read_json(source) if isinstance(source, (str, os.PathLike)) else source)
    given = raw.get("sequence_parallel_size", size)
    if given != size:
        raise ValueError(
            f"config sequence_parallel_size = {given!r} but the mpu's sequence parallel world size is {size}: "
            f"drop the key or set it to {size}"
        )
    raw["sequence_parallel_size"] = size
    return raw


def _config_source(args: Any, config: Any, config_params: Any) -> Any:
    """DeepSpeed's rules: ``config`` or its older alias ``config_params``, else ``args.deepspeed_config`` (or the
    deprecated ``args.deepscale_config``); a config given both ways is an error."""
    if config is None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None)
    deepscale = getattr(args, "deepscale_config", None)
    if deepscale is not None:
        if from_args is not None:
            raise ValueError(
                "initialize(): args has both deepscale_config (deprecated) and deepspeed_config; "
                "keep only --deepspeed_config"
            )
        _LOG.warning("--deepscale_config is deprecated, use --deepspeed_config")
        from_args = deepscale
    if from_args is not None:
        if config is not None:
            raise ValueError(
                "initialize(): a config was given both in args.deepspeed_config and as config=; pass only one"
            )
        config = from_args
    if config is None:
        raise ValueError(
            "initialize() needs a config: config= (a DeepSpeed JSON dict or path) or "
            "args.deepspeed_config (--deepspeed_config, see add_config_arguments)"
        )
    return config


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: Dataset | None = None,
    lr_scheduler: Any = None,
    distributed_port: int = 29500,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable[..., Any] | None = None,
    config: Mapping[str, Any] | str | os.PathLike[str] | None = None,
    mesh_param: Any = None,
    config_params: Mapping[str, Any] | str | os.PathLike[str] | None = None,
    *,
    blocks: list[str] | None = None,
    record_events: bool = False,
    checkpoint_source: TensorSource | None = None,
) -> tuple[Engine, Any, DataLoader | None, Any]:
    """Build a sharded engine; returns ``(engine, optimizer, training_dataloader, lr_scheduler)`` like DeepSpeed.

    DeepSpeed's signature and rules: ``config`` is a DeepSpeed JSON dict or path (``config_params`` is its older
    alias; with neither, ``args.deepspeed_config``). ``optimizer`` may be a client optimizer built over
    ``model.parameters()`` (rebuilt over the shards with the same class and hyperparameters) or a callable taking
    the parameters. ``distributed_port`` is the rendezvous port when no launcher set one; ``dist_init_required=False``
    requires an initialized process group. ``mpu`` may only be the one DeepSpeed's
    ``UlyssesSPAttentionHF.register_with_transformers`` returned (its sequence parallel size becomes the config's
    ``sequence_parallel_size``, its groups the engine's); other mpus and ``mesh_param`` are refused.
    hybridzero's own keyword-only arguments: ``blocks`` overrides the automatic choice of gather groups;
    ``record_events`` records gather/release events; a model built on the meta device is materialized group by
    group, from ``checkpoint_source`` (each rank reads only its shard) or else by the model's own init.
    """
    if model is None:
        raise ValueError("initialize() needs model= (the torch.nn.Module to train)")
    sp_groups = groups_of(mpu)  # DeepSpeed's Ulysses registration (register_with_transformers) as the mpu
    for name, value in (("mpu", None if sp_groups is not None else mpu), ("mesh_param", mesh_param)):
        if value is not None:
            raise ValueError(
                f"initialize({name}=...) is not supported: hybridzero is data-parallel (ZeRO) with Ulysses sequence "
                f'parallelism from the config ("sequence_parallel_size") or from DeepSpeed\'s '
                f"UlyssesSPAttentionHF.register_with_transformers (pass the mpu it returns); pass {name}=None"
            )
    if dist_init_required is False and not comm_api.is_initialized():
        raise RuntimeError(
            "initialize(dist_init_required=False) but torch.distributed is not initialized; call "
            "hybridzero.init_distributed() first or leave dist_init_required=None"
        )
    comm_api.init_distributed(distributed_port=distributed_port)
    comm = Comm(Ledger())
    cfg: Config | None = None
    error: BaseException | None = None
    client_optimizer: torch.optim.Optimizer | None = None
    try:
        source = _config_source(args, config, config_params)
        if sp_groups is not None:
            source = with_sequence_parallel(source, sp_groups.get_sequence_parallel_world_size())
        cfg = load_config(source, comm.world_size)
        if sp_groups is None:  # a registration checked (and switched) the model already
            check_model(getattr(model, "config", None), cfg.sequence_parallel_size)  # heads / attention splittable
        if isinstance(optimizer, torch.optim.Optimizer) or optimizer is None:
            client_optimizer = optimizer
        else:  # DeepSpeed accepts a callable that builds the optimizer over the parameters
            client_optimizer = optimizer(model_parameters if model_parameters is not None else model.parameters())
        check_forced_cpu_optimizer(cfg, client_optimizer)
    except Exception as exc:  # noqa: BLE001 - agreed on below, then re-raised on every rank
        error = exc
    agree(comm, error, "initialize")
    assert cfg is not None
    comm.scope_failures(comm.all_gather_object(uuid.uuid4().hex if comm.rank == 0 else None, phase="init")[0])
    with failure_guard(comm):
        if cfg.seed is not None:
            torch.manual_seed(cfg.seed)
        with paused_init_contexts(model):  # initialize inside the zero.Init block that built the model
            engine = Engine(
                model,
                cfg,
                comm,
                optimizer=client_optimizer,
                model_parameters=model_parameters,
                lr_scheduler=lr_scheduler,
                blocks=blocks,
                record_events=record_events,
                source=checkpoint_source,
                sequence_parallel=None if sp_groups is None else sp_groups.sequence_parallel,
            )
    if training_data is not None:
        engine.training_dataloader = _dataloader(training_data, cfg, comm, collate_fn)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler

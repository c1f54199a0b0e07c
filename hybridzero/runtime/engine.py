"""The training engine: a DeepSpeed-shaped facade over the ZeRO-3 machinery.

Data path of one parameter (see docs/architecture.md): fp32 master shard (optimizer) → compute shard (fp32 or
bf16) → gathered flat buffer around the owning module's forward and backward → gradient copied into the group's
flat gradient → bucketed reduce-scatter → fp32 gradient shard (accumulated over micro-steps) → clip → optimizer
step on the master shard → :meth:`ShardedGroup.write_shard` (the one write path).

Invariants: ``step()`` updates only at the gradient-accumulation boundary; after ``backward()`` and ``step()`` the
engine is quiescent; an exception in an engine call is posted to every peer and tears the process group down so
that no peer hangs.

The training calls (``backward``, ``step``, ``skip_step`` and their accessors) live in runtime/training_calls.py,
the engine's services and DeepSpeed surface in runtime/services.py and runtime/deepspeed_api.py (mixins); what
remains here is construction, ``forward`` and ``destroy``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from hybridzero.comm import topology
from hybridzero.comm.collectives import Comm
from hybridzero.config import Config
from hybridzero.monitor import TrainMeter, build_monitor
from hybridzero.optim import sharded
from hybridzero.optim.factory import build_optimizer, rebuild_optimizer
from hybridzero.optim.loss_scaler import LossScaler, ScalerConfig
from hybridzero.optim.schedulers import build_scheduler
from hybridzero.optim.swap import build_swapper
from hybridzero.runtime import zero_param
from hybridzero.runtime.deepspeed_api import DeepSpeedEngineAPI
from hybridzero.runtime.failures import failure_guard
from hybridzero.runtime.sequence_parallel import SequenceParallel
from hybridzero.runtime.services import EngineServices
from hybridzero.runtime.synced_generation import SyncedGenerationGuard, guard_fits
from hybridzero.runtime.throughput import ThroughputTimer
from hybridzero.runtime.tp_generate import TensorParallelGenerator
from hybridzero.runtime.training_calls import EngineTraining
from hybridzero.runtime.ulysses_hf import release
from hybridzero.runtime.zero_optimizer import ZeroOptimizer
from hybridzero.tensor_source import TensorSource
from hybridzero.zero import leaf, materialize
from hybridzero.zero.coordinator import ZeroCoordinator
from hybridzero.zero.external import external_parameter_names
from hybridzero.zero.gathered import ZeroParamOwner
from hybridzero.zero.groups import ShardedGroup, ShardMode, stage_mode
from hybridzero.zero.init_source import init_stores, release_from_init, stage_group
from hybridzero.zero.offload import Placement
from hybridzero.zero.partition import param_aliases, plan_groups
from hybridzero.zero.prefetch import Prefetcher
from hybridzero.zero.qgz import HierarchicalQuantizedReduce
from hybridzero.zero.reduce import GradReducer, reduction_scales
from hybridzero.zero.registry import REGISTRY

_LOG = logging.getLogger("hybridzero")
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class Engine(EngineTraining, EngineServices, DeepSpeedEngineAPI, nn.Module):  # type: ignore[misc]  # state_dict: full values
    """Wraps ``module`` for sharded training; see :func:`hybridzero.initialize`. An ``nn.Module`` whose one
    submodule is ``module`` (DeepSpeed's engine surface: :mod:`hybridzero.runtime.deepspeed_api`)."""

    def __init__(
        self,
        module: nn.Module,
        config: Config,
        comm: Comm,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        model_parameters: Iterable[Any] | None = None,
        lr_scheduler: Any = None,
        blocks: list[str] | None = None,
        record_events: bool = False,
        source: TensorSource | None = None,
        sequence_parallel: SequenceParallel | None = None,
    ) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.comm = comm
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        zero_param.take_over(module)  # a live engine over this model: whole again from it, then destroyed
        self._init_stores = init_stores(module)  # zero.Init: parameters are placeholders, shards in these stores
        if self._init_stores:
            self.module = materialize.move_buffers(module, self.device)
        else:
            self.module = module if materialize.has_meta(module) else module.to(self.device)
        self.compute_dtype = config.compute_dtype
        comm_dtype = config.communication_data_type
        self.reduce_dtype = _DTYPES[comm_dtype] if comm_dtype else self.compute_dtype
        self.global_steps = 0
        self.micro_steps = 0
        self.boundary_override: bool | None = None  # set_gradient_accumulation_boundary (Accelerate drives it)
        self._grouped_loss: float | None = None  # inside backward_group(): the summed losses of its backwards
        self.tput_timer = ThroughputTimer(config.train_batch_size)  # DeepSpeed's engine.tput_timer
        self.events: list[tuple[str, str, str]] | None = [] if record_events else None
        self.monitor = build_monitor(config.raw, comm.rank)  # tensorboard/csv_monitor/wandb/comet blocks (rank 0)
        self.train_meter = TrainMeter(self.monitor)
        self.last_grad_norm: float | None = None
        f16 = config.fp16
        self.loss_scaler = LossScaler(
            ScalerConfig.from_fp16(
                f16.enabled,
                f16.loss_scale,
                f16.initial_scale_power,
                f16.loss_scale_window,
                f16.hysteresis,
                f16.consecutive_hysteresis,
                f16.min_loss_scale,
            ),
            rank=comm.rank,
            log=_LOG.warning if comm.rank == 0 else None,
        )
        self.skipped_steps = 0
        self.overflow = False
        # fp32/bf16: skip (on every rank) a boundary step whose gradients hold inf/nan anywhere, as fp16 does
        self.skip_nonfinite_steps = bool(getattr(config, "skip_nonfinite_steps", False))
        self.nonfinite_skipped_steps = 0
        self.hpz = self._hpz_comm()
        self.sequence_parallel = self._sequence_parallel(sequence_parallel)  # Ulysses: SP groups (formed by all)
        he = config.hybrid_engine  # tensor-parallel generation: its group is formed now, by every rank together
        self.tp_generator = (
            TensorParallelGenerator(comm, he.inference_tp_size, he.tp_gather_partition_size)
            if he.inference_tp_size > 1
            else None
        )
        off_opt, off_param = config.zero.offload_optimizer, config.zero.offload_param
        self.placement = Placement.build(
            self.device, off_opt.device, off_param.device, off_opt.pin_memory or off_param.pin_memory
        )
        index_of, overrides = sharded.optimizer_groups(module, optimizer, model_parameters)
        self.groups = self._build_groups(blocks, index_of, source)
        if self.placement.params_on_host_only:  # offload_param cpu, optimizer on the device: shards on the CPU
            for group in self.groups:
                group.keep_compute_on_host()
        self._cast_buffers()
        z = config.zero
        self.coordinator = self._build_coordinator()
        self.param_owner = zero_param.EngineParams(ZeroParamOwner(self.coordinator, comm), self, z.stage)
        REGISTRY.register(self.param_owner.zero.params(), self.param_owner)  # GatheredParameters, utils.safe_*
        if z.stage == 3:  # DeepSpeed's read-only ds_* attributes, computed from this engine (runtime.zero_param)
            zero_param.adopt(self.param_owner.zero.params())
        self.training_dataloader: Any = None  # set by initialize when training_data is given
        self.synced_generation = self._synced_generation()
        views = sharded.shard_views(self.groups, index_of, len(overrides))
        if self.placement.state_in_files:  # streamed chunks hold at most sub_group_size elements
            views = sharded.split_views(views, z.sub_group_size)
        self._leaves = sharded.make_leaf_params(views)
        inner = self._build_optimizer(optimizer, overrides)
        # DeepSpeed's engine.optimizer: the torch optimizer behind a delegating facade with the ZeRO wrapper's names
        self.optimizer = ZeroOptimizer(inner, self, z.stage) if inner is not None else None
        # ZeRO-Infinity: optimizer state and sharded masters (and with offload_param nvme compute shards) in files
        self.swapper = build_swapper(z, inner, comm.rank, self.groups, self._leaves)
        self.lr_scheduler = self._build_scheduler(lr_scheduler)

    # --- construction -------------------------------------------------------------------------------------------
    def _build_groups(
        self, blocks: list[str] | None, index_of: dict[str, int], source: TensorSource | None
    ) -> list[ShardedGroup]:
        """One :class:`ShardedGroup` per planned group; a meta-device model is materialized group by group (from
        ``source`` when given, else by the model's own init), so no rank ever holds the whole model."""
        stage = self.config.zero.stage
        threshold = self.config.zero.param_persistence_threshold if stage == 3 else 0
        mode = stage_mode(stage)
        aliases = param_aliases(self.module)
        meta = materialize.has_meta(self.module)
        init_fn = materialize.default_init_fn(self.module)
        if meta:
            materialize.materialize_buffers(self.module, self.device, init_fn)
        leaves: list[str] = []
        if stage == 3:  # zero_optimization.leaf_module marks modules; every marked one is gathered as a unit
            cfg = self.config.zero.leaf_module
            leaf.apply_leaf_config(self.module, cfg.classes, cfg.names, cfg.name_suffixes)
            leaves = leaf.leaf_module_names(self.module)
        groups = []
        external = external_parameter_names(self.module) if stage == 3 else set()  # register_external_parameter
        for i, plan in enumerate(plan_groups(self.module, threshold, blocks, leaves, external)):
            if meta:
                params = materialize.materialize_group(
                    self.module,
                    [aliases[n] for n in plan.param_names],
                    self.device,
                    init_fn if source is None else None,
                )
            else:
                params = [self.module.get_parameter(n) for n in plan.param_names]
            named = sharded.order_for_optimizer(list(zip(plan.param_names, params)), index_of)
            group_mode = ShardMode.PERSISTENT if plan.replicated else mode
            # zero.Init: this rank's pieces of the group, gathered one parameter at a time from the Init store
            group_source = stage_group(named, group_mode, self.comm, self._init_stores) if self._init_stores else source
            groups.append(
                ShardedGroup(
                    i,
                    plan.name,
                    plan.owner,
                    named,
                    self.comm,
                    self.compute_dtype,
                    self.reduce_dtype,
                    self.device,
                    mode=group_mode,
                    source=group_source,
                    aliases={n: aliases[n] for n, _ in named},
                    hpz=self.hpz,
                    quantize_block=self._qwz_block(plan.name, named),
                    placement=self.placement,
                )
            )
        release_from_init(self._init_stores, [slot.param for group in groups for slot in group.slots])
        self._init_stores = []  # released: the engine is the only owner now
        return groups

    def _qwz_block(self, name: str, named: list[tuple[str, nn.Parameter]]) -> int | None:
        """qwZ block size for a group: all groups with ``zero_quantized_weights``, frozen-only groups with
        ``zero_quantized_nontrainable_weights``."""
        z = self.config.zero
        frozen_only = not any(p.requires_grad for _, p in named)
        if z.quantized_weights or (z.quantized_nontrainable_weights and frozen_only):
            return z.quantization_block_size
        return None

    def _hpz_comm(self) -> Comm | None:
        """The node-local hpZ group (``zero_hpz_partition_size`` > 1 at stage 3), checked against the node size."""
        h = self.config.zero.hpz_partition_size
        if h <= 1 or self.config.zero.stage != 3:
            return None
        world = self.comm.world_size
        groups = topology.hpz_groups(world, h, topology.local_world_size(world_size=world))
        return self.comm.split(groups, name="hpz")

    def _sequence_parallel(self, given: SequenceParallel | None) -> SequenceParallel | None:
        """``sequence_parallel_size`` > 1: the SP/DP layout, and the model switched to Ulysses attention (``given``:
        a layout a Ulysses registration formed and attached already, of the config's size)."""
        size = self.config.sequence_parallel_size
        if given is not None:
            assert given.size == size, (given.size, size)
            if not given.attached:  # groups formed without a model (parallel_state_sp.initialize_sequence_parallel)
                given.attach(self.module)
            return given
        if size <= 1:
            return None
        sp = SequenceParallel(self.comm, size)
        sp.attach(self.module)
        return sp

    def _qgz(self) -> HierarchicalQuantizedReduce | None:
        """qgZ over the node layout (``LOCAL_WORLD_SIZE``): node groups and cross-node groups of equal local rank."""
        z = self.config.zero
        if not z.quantized_gradients:
            return None
        if z.stage != 3:
            raise ValueError(f"zero_optimization.zero_quantized_gradients needs stage 3, got stage {z.stage}")
        world = self.comm.world_size
        local = topology.local_world_size(world_size=world)
        nodes = topology.node_groups(world, local)
        cross = [[node[j] for node in nodes] for j in range(local)]
        return HierarchicalQuantizedReduce(
            self.comm.split(nodes, name="node"),
            self.comm.split(cross, name="cross"),
            z.quantized_gradients_bits,
            z.quantization_block_size,
        )

    def _cast_buffers(self) -> None:
        if self.compute_dtype == torch.float32:
            return
        for buf_owner in self.module.modules():
            for name, buf in buf_owner.named_buffers(recurse=False):
                if buf is not None and buf.is_floating_point():
                    setattr(buf_owner, name, buf.to(self.compute_dtype))

    def _build_optimizer(
        self, client: torch.optim.Optimizer | None, overrides: list[dict[str, Any]]
    ) -> torch.optim.Optimizer | None:
        leaves = [[p for p, _ in group] for group in self._leaves]
        if client is not None:
            return rebuild_optimizer(client, leaves)
        if self.config.optimizer is None:
            return None
        param_groups = [{"params": ps, **ov} for ps, ov in zip(leaves, overrides)]
        return build_optimizer(self.config.optimizer.type, self.config.optimizer.params, param_groups)

    def _build_scheduler(self, client: Any) -> Any:
        """Schedulers run on the torch optimizer behind the facade (DeepSpeed hands callables its basic optimizer):
        its ``step`` is the one every path calls, the NVMe swapper's included, so torch's step-order check holds."""
        if self.optimizer is None:
            return None
        torch_optimizer = self.optimizer.optimizer
        if client is not None:
            if callable(client) and not hasattr(client, "step"):
                return client(torch_optimizer)
            client.optimizer = torch_optimizer  # re-point a scheduler built on the client optimizer
            return client
        if self.config.scheduler is not None:
            return build_scheduler(self.config.scheduler.type, self.config.scheduler.params, torch_optimizer)
        return None

    # --- DeepSpeed-shaped API (training calls: runtime/training_calls.py) ---------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module (gathering groups as it goes); a training forward starts ``tput_timer``."""
        with failure_guard(self.comm):
            if self.module.training:
                self.tput_timer.start()
            return self.module(*args, **kwargs)

    def _build_coordinator(self) -> ZeroCoordinator:
        """Prefetcher, gradient reducer and the coordinator that drives the groups through the phases."""
        config, comm, z = self.config, self.comm, self.config.zero
        self.prefetcher = Prefetcher(z.prefetch_bucket_size, z.max_live_parameters, z.max_reuse_distance)
        scales = reduction_scales(
            config.gradient_allreduce_op, config.prescale_gradients, config.gradient_predivide_factor, comm.world_size
        )
        self.reducer = GradReducer(
            comm, z.reduce_bucket_size, overlap=z.overlap_comm, quantized=self._qgz(), scales=scales
        )
        return ZeroCoordinator(
            self.module,
            self.groups,
            self.reducer,
            self.prefetcher,
            self.events,
            check_unused=z.stage in (1, 2) and not z.ignore_unused_parameters,
        )

    def _synced_generation(self) -> SyncedGenerationGuard | None:
        """At ZeRO-3 with peers: mark the module for Hugging Face's sharded-engine protocol (generate() keeps every
        rank stepping, synced_gpus, until all are done, so a rank that finished early still joins the gathers; no
        other state of ours lives on the module) and guard it (a rank leaving that generation with an exception
        cannot strand its peers)."""
        comm, stage = self.comm, self.config.zero.stage
        if comm.world_size > 1 and stage == 3:
            setattr(self.module, "_is_fsdp_managed_module", True)  # noqa: B010 - HF reads this flag
        if stage == 3 and comm.group is None and guard_fits(comm.world_size):
            return SyncedGenerationGuard(self.module, comm, self.coordinator, self.device)
        return None

    def destroy(self) -> None:
        """DeepSpeed's ``destroy`` (:class:`DeepSpeedEngineAPI`), and the NVMe swap directory removed."""
        super().destroy()
        self.monitor.close()
        if self.sequence_parallel is not None:
            self.sequence_parallel.detach()
            release(self.sequence_parallel)
        if self.synced_generation is not None:
            self.synced_generation.remove()
        if self.swapper is not None:
            self.swapper.close()

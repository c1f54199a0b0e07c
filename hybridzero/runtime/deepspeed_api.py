"""DeepSpeed's engine surface: the methods DeepSpeed's Training API documents, as a mixin of :class:`Engine`.

The engine is an ``nn.Module`` (as DeepSpeed's) whose only submodule is the user's model, ``module``; nothing else of
the engine is a submodule, parameter or buffer, so ``parameters()``, ``named_parameters()`` (``module.``-prefixed
names) and ``train()/eval()`` are ``nn.Module``'s. Attribute access the engine does not answer falls through to the
wrapped module (``engine.config`` is the engine's config; ``engine.generate`` is the hybrid engine's).

Differences from DeepSpeed, on purpose (README, "Coming from DeepSpeed"):

* ``state_dict()`` / ``module_state_dict()`` return full values at every stage (ZeRO-3 groups are gathered one at a
  time, every rank calls it and gets every value; DeepSpeed returns empty partitions at ZeRO-3). ``keep_vars=True``
  gives ``Parameter`` objects where parameters are whole (stages 0-2, persistent ones) and detached full copies of
  ZeRO-3 parameters.
* ``load_state_dict()`` writes through the one write path (every rank calls it with the same dict).
* ``get_global_grad_norm()`` is the norm the last step computed for clipping (``None`` without clipping).
* ``no_sync()`` raises: gradients are reduced into shards every micro-step at every stage (DeepSpeed raises at
  ZeRO 2/3 for the same reason).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from hybridzero.checkpoint.format import STATE_JSON
from hybridzero.checkpoint.recovery import make_executable
from hybridzero.comm.collectives import Comm
from hybridzero.config import Config
from hybridzero.runtime import zero_param
from hybridzero.runtime.fragments import TensorFragments, master_range
from hybridzero.runtime.zero_optimizer import ZeroOptimizer
from hybridzero.zero.coordinator import ZeroCoordinator
from hybridzero.zero.registry import REGISTRY

_PREFIX = "module."


class CallableInt(int):
    """An ``int`` that also answers ``()`` with itself: DeepSpeed's ``engine.gradient_accumulation_steps()`` is a
    method, while hybridzero's own code read it as a value; both spellings stay valid."""

    def __call__(self) -> int:
        return int(self)


class DeepSpeedEngineAPI:
    """DeepSpeed-named engine methods over the engine's public state (see the module docstring)."""

    module: nn.Module
    config: Config
    comm: Comm
    coordinator: ZeroCoordinator
    param_owner: TensorFragments
    optimizer: ZeroOptimizer | None
    last_grad_norm: float | None
    boundary_override: bool | None
    global_steps: int

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # type: ignore[misc]  # nn.Module's: submodules, parameters, buffers
        except AttributeError:
            modules = self.__dict__.get("_modules")
            module = modules.get("module") if modules else None
            if module is not None and name != "module":
                return getattr(module, name)
            raise

    # --- batch and precision -------------------------------------------------------------------------------------
    @property
    def gradient_accumulation_steps(self) -> CallableInt:
        """Micro-steps per optimizer step (``engine.gradient_accumulation_steps()`` as in DeepSpeed)."""
        return CallableInt(self.config.gradient_accumulation_steps)

    def train_batch_size(self) -> int:
        """Samples per optimizer step over all ranks."""
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per micro-step on one rank."""
        return self.config.train_micro_batch_size_per_gpu

    @property
    def global_samples(self) -> int:
        """Samples consumed by the optimizer steps taken so far."""
        return self.global_steps * self.config.train_batch_size

    def gradient_clipping(self) -> float:
        """The ``gradient_clipping`` max norm (0: off)."""
        return self.config.gradient_clipping

    def steps_per_print(self) -> int:
        """The ``steps_per_print`` interval."""
        return self.config.steps_per_print

    def fp16_enabled(self) -> bool:
        """``fp16.enabled``."""
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        """``bf16.enabled``."""
        return self.config.compute_dtype == torch.bfloat16

    def zero_optimization_stage(self) -> int:
        """The ZeRO stage (0-3)."""
        return self.config.zero.stage

    def zero_optimization(self) -> bool:
        """True at ZeRO stages 1-3."""
        return self.config.zero.stage > 0

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm (before clipping) of the last applied step, as DeepSpeed's; ``None`` before the
        first."""
        return self.last_grad_norm

    # --- ranks ------------------------------------------------------------------------------------------------------
    @property
    def global_rank(self) -> int:
        """This process's rank in the world."""
        return self.comm.rank

    @property
    def world_size(self) -> int:
        """Ranks in the world."""
        return self.comm.world_size

    @property
    def dp_world_size(self) -> int:
        """Data-parallel ranks (the whole world: hybridzero has no model parallelism)."""
        return self.comm.world_size

    @property
    def local_rank(self) -> int:
        """Rank on this node (``LOCAL_RANK`` from the launcher; 0 without one)."""
        return int(os.environ.get("LOCAL_RANK", "0"))

    # --- lifecycle ------------------------------------------------------------------------------------------------
    def allreduce_gradients(self, bucket_size: int | None = None) -> None:
        """DeepSpeed's explicit gradient reduction: nothing to do here, every backward ends with its gradients
        reduced into the fp32 gradient shards (read them through ``engine.optimizer.averaged_gradients``)."""
        del bucket_size  # accepted for DeepSpeed's signature; reduction buckets come from reduce_bucket_size

    def empty_partition_cache(self) -> None:
        """Release every gathered ZeRO-3 buffer (not those pinned by an open ``GatheredParameters``), the hpZ
        secondary shards and, as DeepSpeed, the persistent parameters' whole copies: every parameter is size 0
        until the model next runs or is read through the engine, which brings the persistent ones back from their
        whole masters (no collective). Between steps only; a no-op inside a forward or backward."""
        self.coordinator.release_held()
        if self.coordinator.is_quiescent():
            for group in self.coordinator.groups:
                group.drop_secondary()
            self.coordinator.evict_whole()

    def destroy(self) -> None:
        """Detach from the module: hooks removed, gathered buffers released, parameters no longer owned (the
        engine is unusable afterwards; ZeRO-3 parameters stay placeholders, as in DeepSpeed)."""
        self.coordinator.remove_hooks()
        REGISTRY.unregister(self.param_owner.zero.params(), self.param_owner)
        zero_param.release(self.param_owner.zero.params())
        self.module.__dict__.pop("_is_fsdp_managed_module", None)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Not supported: gradients are reduced into shards at every micro-step (see the module docstring)."""
        raise RuntimeError(
            "engine.no_sync() is not supported: hybridzero reduces gradients into shards at every "
            "micro-step at every ZeRO stage (DeepSpeed raises at stages 2-3); accumulate with "
            "gradient_accumulation_steps instead"
        )
        yield  # pragma: no cover

    # --- what Hugging Face Trainer and Accelerate call ------------------------------------------------------------
    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's: the caller says whether the coming ``step()`` ends the accumulation window (Accelerate
        calls it before every ``backward`` and calls ``step()`` only at the boundary)."""
        self.boundary_override = bool(is_boundary)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """``zero_optimization.stage3_gather_16bit_weights_on_model_save`` (whether full weights may be gathered)."""
        return bool(self.config.zero.gather_16bit_weights_on_model_save)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, Any]:
        """DeepSpeed's name for the module's full state dict in the compute dtype (Trainer's ``save_model``,
        Accelerate's ``get_state_dict``): :meth:`module_state_dict`, on every rank (DeepSpeed: rank 0 only)."""
        return self.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)

    @property
    def sparse_tensor_module_names(self) -> set[str]:
        """DeepSpeed's set of modules whose gradients it all-reduces as sparse tensors (``sparse_gradients``):
        always empty, as hybridzero reduces every gradient dense (``sparse_gradients`` is accepted, without effect).
        A fresh set each time, so editing it changes nothing."""
        return set()

    def _change_recovery_script_permissions(self, dst: str | os.PathLike[str]) -> bool:
        """Make the recovery script ``dst`` executable (``save_checkpoint`` does it for the ``zero_to_fp32.py`` it
        writes, :mod:`hybridzero.checkpoint.recovery`); a file system that refuses is logged at info level on
        DeepSpeed's logger, not raised."""
        return make_executable(dst, logging.getLogger("DeepSpeed"))

    def _get_optimizer_ckpt_name(self, checkpoints_path: str | os.PathLike[str], tag: Any, expp_rank: int = 0) -> str:
        """DeepSpeed's name for the file a checkpoint's optimizer state is read from: here the tag's ``state.json``
        (hyperparameters and per-group state; the per-element tensors are in the rank files it lists).
        ``load_checkpoint`` asks for it only when it loads optimizer state. ``expp_rank`` (DeepSpeed's
        expert-parallel rank) must be 0: hybridzero has no expert parallelism."""
        if expp_rank != 0:
            raise ValueError(f"_get_optimizer_ckpt_name: expp_rank={expp_rank} is invalid: hybridzero has only 0")
        return os.path.join(os.fspath(checkpoints_path), str(tag), STATE_JSON)

    # --- state dicts ----------------------------------------------------------------------------------------------
    def module_state_dict(
        self,
        destination: dict[str, Any] | None = None,
        prefix: str = "",
        keep_vars: bool = False,
        exclude_frozen_parameters: bool = False,
    ) -> dict[str, Any]:
        """The wrapped module's state dict with full values in the compute dtype, as the module computes with them
        (a collective at ZeRO-3: every rank calls it). ``safe_get_full_fp32_param`` gives the fp32 masters."""
        base = self.module.state_dict(prefix=prefix, keep_vars=True)
        full: dict[int, torch.Tensor] = {}
        for group in self.param_owner.zero.each_gathered("state_dict"):
            for slot in group.slots:
                value = slot.param if keep_vars and group.always_full else slot.param.detach()
                full[id(slot.param)] = value if group.always_full else value.clone()
        out: dict[str, Any] = destination if destination is not None else OrderedDict()
        for key, value in base.items():
            if exclude_frozen_parameters and isinstance(value, nn.Parameter) and not value.requires_grad:
                continue
            value = full.get(id(value), value)
            out[key] = value if keep_vars or not isinstance(value, torch.Tensor) else value.detach()
        return out

    def state_dict(
        self, *args: Any, destination: dict[str, Any] | None = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        """``nn.Module.state_dict`` of the engine (keys ``module.<name>``), with full values (see module docstring)."""
        if args:
            raise TypeError("engine.state_dict() takes keyword arguments only (destination=, prefix=, keep_vars=)")
        return self.module_state_dict(destination, prefix + _PREFIX, keep_vars)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> _IncompatibleKeys:
        """Load full values (keys as :meth:`state_dict` returns them) into the masters, group by group, through
        ``write_shard``; buffers are copied. Every rank calls it with the same values."""
        if assign:
            raise ValueError(
                "engine.load_state_dict(assign=True) is not supported: parameters are views into "
                "sharded buffers; load values with assign=False"
            )
        values = {k[len(_PREFIX) :]: v for k, v in state_dict.items() if k.startswith(_PREFIX)}
        unexpected = [k for k in state_dict if not k.startswith(_PREFIX)]
        expected = self.module.state_dict(keep_vars=True)
        unexpected += [_PREFIX + k for k in values if k not in expected]
        missing = [_PREFIX + k for k in expected if k not in values]
        if strict and (missing or unexpected):
            raise RuntimeError(f"engine.load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        by_param = {id(t): values[k] for k, t in expected.items() if k in values}
        for group in self.param_owner.zero.groups:  # every shape checked before anything is written
            for slot in group.slots:
                value = by_param.get(id(slot.param))
                if value is not None and tuple(value.shape) != tuple(slot.spec.shape):
                    raise ValueError(
                        f"engine.load_state_dict: {slot.spec.name!r} has shape {tuple(value.shape)}, "
                        f"the parameter has {tuple(slot.spec.shape)}"
                    )
        with torch.no_grad():
            for key, tensor in expected.items():
                if key in values and not isinstance(tensor, nn.Parameter):
                    tensor.copy_(values[key])
            for group in self.param_owner.zero.groups:
                hits = [s for s in group.slots if id(s.param) in by_param]
                if not hits:
                    continue
                self.param_owner.zero.check_not_gathered(group, "engine.load_state_dict")
                lo, hi = master_range(group)
                with group.master_resident() as master:  # NVMe offload: written back to its file
                    for slot in hits:
                        flat = by_param[id(slot.param)].detach().reshape(-1).to(master)
                        a, b = max(lo, slot.spec.offset), min(hi, slot.spec.end)
                        if a < b:
                            master[a - lo : b - lo].copy_(flat[a - slot.spec.offset : b - slot.spec.offset])
                    group.write_shard()
        return _IncompatibleKeys(missing, unexpected)

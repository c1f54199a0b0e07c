"""The engine's services beyond the training calls, as a mixin of :class:`~hybridzero.runtime.engine.Engine`: the
hybrid engine's generation, checkpoints (DeepSpeed's ``save_checkpoint`` / ``load_checkpoint`` /
``save_16bit_model``), the memory report, full parameters and the EMA update. Each method is a thin, documented
entry point over the module that does the work (:mod:`.hybrid`, :mod:`.checkpointing`, :mod:`.weights16`,
:mod:`.memory`); the mixin holds no state of its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import nn

from hybridzero.comm.collectives import Comm
from hybridzero.config import Config
from hybridzero.optim.swap import StateSwapper
from hybridzero.runtime import checkpointing, weights16
from hybridzero.runtime.checkpointing import Checkpointable
from hybridzero.runtime.failures import failure_guard, leave_synced_generation
from hybridzero.runtime.hybrid import check_out_tokens, gathered_bytes, generation_mode, hybrid_generate
from hybridzero.runtime.memory import memory_report
from hybridzero.runtime.sequence_parallel import SequenceParallel
from hybridzero.runtime.tp_generate import TensorParallelGenerator
from hybridzero.runtime.zero_optimizer import ZeroOptimizer
from hybridzero.zero.coordinator import ZeroCoordinator
from hybridzero.zero.gathered import GatheredParameters, HasParamOwner
from hybridzero.zero.groups import ShardedGroup
from hybridzero.zero.offload import Placement, move


class EngineServices:
    """Generation, checkpoints, memory report, full parameters, EMA (see the module docstring)."""

    module: nn.Module
    config: Config
    comm: Comm
    coordinator: ZeroCoordinator
    groups: list[ShardedGroup]
    optimizer: ZeroOptimizer | None
    placement: Placement
    swapper: StateSwapper | None
    device: torch.device
    tp_generator: TensorParallelGenerator | None
    sequence_parallel: SequenceParallel | None

    def release_held(self) -> None:
        """Provided by the engine (declared here for the type checker)."""

    def _checkpointable(self) -> Checkpointable:
        """This engine as the checkpointer sees it (the concrete engine has every attribute the Protocol names)."""
        return cast(Checkpointable, self)

    def generate(self, *args: Any, max_gathered_bytes: int | None = None, **kwargs: Any) -> Any:
        """Hybrid-engine generation (HF ``generate`` arguments): parameters gathered once, no collective while
        decoding, shards untouched. See :mod:`hybridzero.runtime.hybrid`; with ``hybrid_engine.inference_tp_size``
        > 1 the model is split over groups of ranks instead (:mod:`hybridzero.runtime.tp_generate`). Under sequence
        parallelism the model runs its own attention meanwhile: every rank generates for the prompts it passes, as
        without SP (forwards outside keep the Ulysses attention)."""
        with self._local_attention():  # SP: a decode step cannot be split; each rank generates for its own prompts
            return self._generate(*args, max_gathered_bytes=max_gathered_bytes, **kwargs)

    def _local_attention(self) -> contextlib.AbstractContextManager[None]:
        """Under sequence parallelism: the model's own attention inside (``SequenceParallel.local_attention``)."""
        sp = self.sequence_parallel
        return sp.local_attention() if sp is not None else contextlib.nullcontext()

    def _generate(self, *args: Any, max_gathered_bytes: int | None = None, **kwargs: Any) -> Any:
        """:meth:`generate` with the attention as it is (local under SP)."""
        # Full mode exchanges nothing until exit, so an exception there (a stopping criterion, a logits processor) is
        # local: it reaches the caller unchanged and the engine stays usable. Bucketed mode (the same test as
        # generation_mode's) is HF's synced generation over the ZeRO-3 hooks: peers wait in collectives this rank
        # left, so an exception there is fatal to the group and reaches every peer as PeerFailure.
        limit = self.config.hybrid_engine.max_out_tokens
        check_out_tokens(limit, args, kwargs)  # before the guard: a too-long request is not a group failure
        if self.tp_generator is not None:  # tensor-parallel: the group decodes one joint batch
            with failure_guard(self.comm):  # peers wait in the group's all-reduces: a failure here is fatal
                return self.tp_generator.generate(
                    self.coordinator, *args, max_gathered_bytes=max_gathered_bytes, **kwargs
                )
        bucketed = max_gathered_bytes is not None and gathered_bytes(self.coordinator) > max_gathered_bytes
        if not bucketed:
            return hybrid_generate(self.coordinator, limit, *args, max_gathered_bytes=max_gathered_bytes, **kwargs)
        with failure_guard(self.comm):
            try:
                return hybrid_generate(self.coordinator, limit, *args, max_gathered_bytes=max_gathered_bytes, **kwargs)
            except Exception as exc:
                # HF syncs when asked, or by default for a module that declares itself sharded (ZeRO-3 here)
                if kwargs.get("synced_gpus", getattr(self.module, "_is_fsdp_managed_module", False)):
                    leave_synced_generation(self.comm, exc, self.device)
                raise

    @contextlib.contextmanager
    def generation_mode(self, max_gathered_bytes: int | None = None, keep_mode: bool = False) -> Iterator[str]:
        """``with engine.generation_mode():`` — the module runs on fully gathered parameters inside the block (in eval
        mode; ``keep_mode``: in the mode it is in; every submodule's mode is restored on exit). Under sequence
        parallelism the module runs its own attention inside, on whole sequences (as :meth:`generate`)."""
        with self._local_attention(), generation_mode(self.coordinator, max_gathered_bytes, keep_mode) as mode:
            yield mode

    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """DeepSpeed's ``save_checkpoint``: a sharded, checksummed, atomic checkpoint (every rank calls it; also
        inside an accumulation window, without the partial gradients). See :mod:`hybridzero.runtime.checkpointing`."""
        with self.optimizer_state_resident():  # NVMe offload: the state is read through memory, never the swap files
            return checkpointing.save(
                self._checkpointable(), save_dir, tag, client_state, save_latest, exclude_frozen_parameters
            )

    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[str | None, Any]:
        """DeepSpeed's ``load_checkpoint``: ``(load_path, client_state)``, ``(None, None)`` when there is nothing to
        load. Verified on every rank before anything changes: a bad checkpoint raises ``CheckpointError`` on every
        rank and leaves the engine as it was."""
        with self.optimizer_state_resident():  # NVMe offload: loaded state goes to the swap files on exit
            staged = checkpointing.prepare_load(
                self._checkpointable(),
                load_dir,
                tag,
                load_module_strict,
                load_optimizer_states,
                load_lr_scheduler_states,
                load_module_only,
            )
            if staged is None:
                return None, None
            with failure_guard(self.comm):
                return checkpointing.apply_load(self._checkpointable(), staged)

    def save_16bit_model(
        self, save_dir: str, save_filename: str = "pytorch_model.bin", exclude_frozen_parameters: bool = False
    ) -> bool:
        """DeepSpeed's ``save_16bit_model``: consolidated weights in the compute dtype, written by rank 0 (every
        rank calls it); False and nothing written at stage 3 without ``stage3_gather_16bit_weights_on_model_save``."""
        self.release_held()
        gather = self.config.zero.stage != 3 or self.config.zero.gather_16bit_weights_on_model_save
        full = self.full_parameters() if gather else None
        return weights16.save_16bit_model(
            self._checkpointable(), full, save_dir, save_filename, exclude_frozen_parameters
        )

    def optimizer_state_resident(self) -> contextlib.AbstractContextManager[None]:
        """Every leaf's optimizer state in ``optimizer.state`` for the block; with NVMe offload it is read from the
        swap file and written back after (checkpoints and the fragment API read state only through this)."""
        return self.swapper.resident() if self.swapper is not None else contextlib.nullcontext()

    def memory_report(self) -> dict[str, Any]:
        """Bytes of parameters, master weights, gradients, optimizer state and live gathered buffers on this rank,
        and under ``"placement"`` where each category lives (device / host / file) with its bytes."""
        return memory_report(self.groups, self.optimizer, self.placement, self.swapper)

    def gathered_parameters(self, params: Any, modifier_rank: int | None = None) -> Any:
        """``with engine.gathered_parameters(params, modifier_rank=0):`` — see :mod:`hybridzero.zero.gathered`."""
        return GatheredParameters(params, modifier_rank, engine=cast(HasParamOwner, self))

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter in full (fp32 master values), gathered group by group; every rank gets all of them."""
        out: dict[str, torch.Tensor] = {}
        for group in self.groups:
            if group.master_is_whole:
                flat = group.master
            else:
                flat = torch.empty(group.layout.padded_numel, dtype=torch.float32, device=self.device)
                with group.master_resident() as master:  # NVMe offload: read from its file for the gather
                    self.comm.all_gather(flat, move(master, self.device), phase="consolidate")
            for slot in group.slots:
                out[slot.spec.name] = flat[slot.spec.offset : slot.spec.end].view(slot.spec.shape).clone()
        return out

    def ema_update_from(self, source: EngineServices, beta: float) -> None:
        """``self = beta * self + (1 - beta) * source`` on this rank's fp32 master shards, then written through
        :meth:`ShardedGroup.write_shard` (no communication). Both engines must hold the same model with the same
        layout (same ZeRO stage and world); a mismatch raises naming the group before anything is written."""
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"ema_update_from: beta = {beta!r} must be in [0, 1]")
        if len(self.groups) != len(source.groups):
            raise ValueError(
                f"ema_update_from: this engine has {len(self.groups)} groups, the source "
                f"{len(source.groups)}: build both from the same model with the same ZeRO stage"
            )
        for mine, theirs in zip(self.groups, source.groups):
            same_shard = (mine.master_is_whole, mine.layout.shard_numel) == (
                theirs.master_is_whole,
                theirs.layout.shard_numel,
            )  # compared on metadata: a master in an NVMe file is an empty placeholder here
            if not same_shard or mine.layout.specs != theirs.layout.specs:
                raise ValueError(f"ema_update_from: group {mine.name!r} does not match the source's layout")
        with torch.no_grad():
            for mine, theirs in zip(self.groups, source.groups):
                with mine.master_resident() as master, theirs.master_resident() as other:  # NVMe offload
                    master.mul_(beta).add_(other, alpha=1.0 - beta)
                    mine.write_shard()

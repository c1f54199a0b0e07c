"""The engine's training calls, as a mixin of :class:`~hybridzero.runtime.engine.Engine`: ``backward`` (and
``backward_group``), ``step`` / ``skip_step`` with the gradient-accumulation boundary, the fp16 loss scale and the
non-finite skip, and the accessors around them (``zero_grad``, ``get_lr``, ``was_step_applied``, ...).

Invariants: ``step()`` updates only at the gradient-accumulation boundary; after ``backward()`` and ``step()`` the
engine is quiescent; an exception in a training call is posted to every peer (:func:`.failures.failure_guard`) and
tears the process group down so that no peer hangs. The mixin holds no state of its own: the engine's constructor
sets every attribute declared below.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from hybridzero.comm.ledger import Ledger
from hybridzero.monitor import TrainMeter
from hybridzero.optim import sharded
from hybridzero.optim.loss_scaler import LossScaler, overflow_flag
from hybridzero.optim.swap import StateSwapper
from hybridzero.runtime.deepspeed_api import DeepSpeedEngineAPI
from hybridzero.runtime.failures import failure_guard
from hybridzero.runtime.throughput import ThroughputTimer
from hybridzero.zero.groups import ShardedGroup

_LOG = logging.getLogger("hybridzero")

_REPOINTED = re.escape("Seems like `optimizer.step()` has been overridden after learning rate scheduler")


class EngineTraining(DeepSpeedEngineAPI):
    """backward / step / skip_step and their accessors over the engine's state (see the module docstring)."""

    groups: list[ShardedGroup]
    device: torch.device
    compute_dtype: torch.dtype
    micro_steps: int
    skipped_steps: int
    nonfinite_skipped_steps: int
    overflow: bool
    skip_nonfinite_steps: bool
    loss_scaler: LossScaler
    tput_timer: ThroughputTimer
    train_meter: TrainMeter
    swapper: StateSwapper | None
    lr_scheduler: Any
    _grouped_loss: float | None
    _leaves: list[list[tuple[nn.Parameter, torch.Tensor]]]

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next ``step()`` applies the update (``set_gradient_accumulation_boundary`` decides when
        it was called, as in DeepSpeed; otherwise every ``gradient_accumulation_steps``-th ``step()``)."""
        if self.boundary_override is not None:
            return self.boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> None:
        """Backpropagate ``loss / gradient_accumulation_steps`` (``scale_wrt_gas=False``: ``loss`` as given, for
        callers that divided already, as HF Trainer does); gradients land reduced in the fp32 shards."""
        with failure_guard(self.comm):
            gas = self.gradient_accumulation_steps if scale_wrt_gas else 1
            if self._grouped_loss is None:
                self.train_meter.observe_loss(loss)
            else:  # one micro-batch in parts: observed once, as their sum, when the group closes
                self._grouped_loss += float(loss.detach().float().sum())
            if self.config.fp16.enabled:
                loss = loss.float() * self.loss_scaler.scale
            try:
                (loss / gas if gas > 1 else loss).backward(retain_graph=retain_graph)
            except BaseException:
                self.coordinator.abort()  # autograd skips queued callbacks when backward raises
                raise

    @contextmanager
    def backward_group(self) -> Iterator[None]:
        """Group several ``backward()`` calls into one micro-step (a micro-batch forwarded in token-budgeted parts).

        Invariant: the group changes no accounting. Each ``backward()`` inside scales by ``gradient_accumulation_
        steps`` as usual and its gradients add into the same fp32 shards, so parts whose losses *sum* to the
        micro-batch loss leave exactly the gradients of one ``backward(micro-batch loss)`` (up to summation order).
        ``micro_steps``, the boundary and ``step()`` are untouched: call ``step()`` once after the group, as after
        one ``backward()``. The monitor observes one loss, the parts' sum, when the group closes. Groups don't nest.
        """
        if self._grouped_loss is not None:
            raise RuntimeError("engine.backward_group(): groups don't nest (one group per micro-step)")
        self._grouped_loss = 0.0
        try:
            yield
            self.train_meter.observe_loss(self._grouped_loss)
        finally:
            self._grouped_loss = None

    def step(self) -> None:
        """At the accumulation boundary: clip, update master shards, propagate, zero gradients."""
        with failure_guard(self.comm):
            boundary = self.is_gradient_accumulation_boundary()
            self.tput_timer.stop(global_step=boundary)
            if boundary:
                self._apply_update()
                self.global_steps += 1
                self._report_progress()
            gas = self.gradient_accumulation_steps
            # a caller that sets the boundary itself calls step() only there: the window is complete
            ahead = gas - self.micro_steps % gas if boundary and self.boundary_override is not None else 1
            self.micro_steps += ahead

    def _report_progress(self) -> None:
        """DeepSpeed's progress line every ``steps_per_print`` optimizer steps (rank 0, ``logging`` INFO) and the
        monitor's events of the step (:mod:`hybridzero.monitor`)."""
        samples = self.global_samples
        scale = self.loss_scaler.scale if self.config.fp16.enabled else None
        lrs = self.get_lr()
        self.train_meter.step_done(lrs[0] if lrs else None, scale, samples - self.train_batch_size(), samples)
        if self.comm.rank == 0 and self.global_steps % self.config.steps_per_print == 0:
            _LOG.info("step=%d, skipped=%d, lr=%s", self.global_steps, self.skipped_steps, self.get_lr())

    def _apply_update(self) -> None:
        if self._zero_step():
            if self.lr_scheduler is not None:
                with warnings.catch_warnings():  # the order is this call's own: right after the optimizer step
                    # a client scheduler re-pointed at the torch optimizer behind the facade (engine._build_scheduler)
                    # finds that optimizer's step not wrapped by torch's order check, and torch says so
                    warnings.filterwarnings("ignore", message=_REPOINTED, category=UserWarning)
                    self.lr_scheduler.step()
            with self.comm.ledger.timer.region("copy.zero_grad"):
                self.zero_grad()

    def optimizer_step(self) -> bool:
        """DeepSpeed's ZeRO optimizer step on its own (``engine.optimizer.step()``), under the failure guard as every
        training call: an exception on one rank makes its peers raise instead of waiting."""
        with failure_guard(self.comm):
            return self._zero_step()

    def _zero_step(self) -> bool:
        """The ZeRO step (``engine.step()`` runs it at the boundary, then the scheduler and ``zero_grad``): agree on
        overflow (fp16, ``skip_nonfinite_steps``), unscale, compute the global gradient norm (always, as DeepSpeed:
        ``get_global_grad_norm()``) and clip by it when ``gradient_clipping`` is set, step the fp32 master shards
        and propagate them. Every rank calls it. Returns whether the update was applied (False: skipped for
        inf/nan, gradients dropped)."""
        if self.optimizer is None:
            raise RuntimeError("engine.step() needs an optimizer: pass optimizer= or an 'optimizer' config block")
        self.release_held()
        self.assert_quiescent()
        self.overflow = False
        if self.config.fp16.enabled and not self._unscale_or_skip():
            return False
        if not self.config.fp16.enabled and self.skip_nonfinite_steps and self._skip_nonfinite():
            return False
        timer = self.comm.ledger.timer  # the step profile's regions (no-ops unless a benchmark turns it on)
        with timer.region("compute.optimizer"):
            if self.config.gradient_clipping > 0:
                norm = sharded.clip_grad_shards(self.groups, self.comm, self.config.gradient_clipping)
            else:
                norm = sharded.global_grad_norm(self.groups, self.comm)
            self.last_grad_norm = float(norm)
        trained = [g for g in self.groups if g.n_trainable > 0]  # frozen groups never change: nothing to move
        for group in trained:
            group.assemble_grad()
        with timer.region("compute.optimizer"):
            if self.swapper is not None:
                self.swapper.step()  # ZeRO-Infinity: master + state streamed chunk by chunk (grads bound per chunk)
            else:
                sharded.bind_grads(self._leaves)
                with self.optimizer.stepping_inner():
                    self.optimizer.step()  # the facade, as a scheduler wraps it: the inner optimizer's step
        with timer.region("copy.write_shard"):
            for group in trained:
                group.write_shard()
        return True

    def _unscale_or_skip(self) -> bool:
        """fp16: agree on overflow across ranks (MAX of a local inf/nan flag), move the loss scale, and either skip
        the step on every rank (False) or unscale the gradient shards (True)."""
        used = self.loss_scaler.scale
        flag = overflow_flag([g.grad_shard for g in self.groups], device=self.device)
        self.comm.all_reduce(flag, op="max", phase="step")
        self.overflow = self.loss_scaler.update(bool(flag.item() > 0))
        if self.overflow:
            self.skipped_steps += 1
            self.zero_grad()
            return False
        for group in self.groups:
            group.grad_shard.div_(used)
        return True

    def _skip_nonfinite(self) -> bool:
        """fp32/bf16 with ``skip_nonfinite_steps``: the fp16 overflow agreement without a loss scale (one MAX
        all-reduce of a local inf/nan flag). On inf/nan anywhere every rank drops the gradients and skips the update,
        optimizer and scheduler untouched (True); the step still counts in ``global_steps``."""
        if not self.check_overflow():
            return False
        self.overflow = True
        self.skipped_steps += 1
        self.nonfinite_skipped_steps += 1
        self.zero_grad()
        if self.comm.rank == 0:
            _LOG.warning(
                "[hybridzero] OVERFLOW! Rank 0 Skipping step %d. Non-finite (inf/nan) gradients with %s; "
                "skipped steps: %d",
                self.global_steps + 1,
                self.compute_dtype,
                self.skipped_steps,
            )
        return True

    def check_overflow(self) -> bool:
        """True if any rank's gradient shards hold inf/nan (a counted MAX all-reduce; every rank calls it, before
        ``step``), with fp16 or ``skip_nonfinite_steps``. Otherwise False, exchanging nothing. Leaves the loss scale
        alone."""
        if not (self.config.fp16.enabled or self.skip_nonfinite_steps):
            return False
        flag = overflow_flag([g.grad_shard for g in self.groups], device=self.device)
        self.comm.all_reduce(flag, op="max", phase="step")
        return bool(flag.item() > 0)

    def skip_step(self) -> None:
        """``step()`` without an update: at the boundary the gradients are dropped, the loss scale, optimizer and
        scheduler are untouched, ``was_step_applied()`` is False and the step still counts (as a DeepSpeed skipped
        step). For updates that must skip together (DeepSpeed-Chat's ``align_overflow``)."""
        with failure_guard(self.comm):
            if self.is_gradient_accumulation_boundary():
                self.release_held()
                self.zero_grad()
                self.overflow = True
                self.skipped_steps += 1
                self.global_steps += 1
            self.micro_steps += 1

    def release_held(self) -> None:
        """Release groups a grad-enabled forward kept gathered for a backward that has not come (no-op otherwise)."""
        self.coordinator.release_held()

    def was_step_applied(self) -> bool:
        """False if the last optimizer step was skipped (fp16 overflow on any rank), as in DeepSpeed."""
        return not self.overflow

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 when fp16 is off)."""
        return self.loss_scaler.scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the fp32 gradient shards (``set_to_none`` is accepted for ``nn.Module`` compatibility)."""
        for group in self.groups:
            group.grad_shard.zero_()

    def get_lr(self) -> list[float]:
        """Current learning rate of every optimizer param group."""
        return [] if self.optimizer is None else [float(g["lr"]) for g in self.optimizer.param_groups]

    def comm_ledger(self) -> Ledger:
        """Calls and bytes of every collective, per (collective, group, phase)."""
        return self.comm.ledger

    def assert_quiescent(self) -> None:
        """Raise if anything is gathered (but persisted parameters), pending or unreduced."""
        self.coordinator.assert_quiescent()

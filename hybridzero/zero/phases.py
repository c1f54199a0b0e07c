"""The phase machine of a :class:`~hybridzero.zero.coordinator.ZeroCoordinator`: its state and its transitions.

:class:`PhaseMachine` owns what a phase is made of -- the phase itself, the groups held gathered across the
forward->backward boundary, the gradients delivered in this backward, the peak of gathered bytes -- and the moves
between phases: ``use`` (gather now, after the prefetch the trace suggests), ``release``, ``end_phase`` (drain and
release everything but what a backward will reuse; close the prefetch trace), ``abort`` and the quiescence checks.
The hooks that turn a module's events into these moves live in :mod:`hybridzero.zero.coordinator`, the one
subclass; nothing here installs a hook or reads ``module.training``.

Invariants (held with the coordinator's hooks, checked by ``engine.assert_quiescent()``):
* ``end_phase`` leaves the machine IDLE with every group but those in ``keep`` released and the prefetch trace
  closed: prefetch never crosses a phase end.
* Prefetch and the reuse rule (``_keep_for_backward``) are hints: they change when a group is gathered, never which
  values a computation sees.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from hybridzero.zero.coalesce import start_gathers
from hybridzero.zero.groups import GroupState, ShardedGroup
from hybridzero.zero.prefetch import Prefetcher
from hybridzero.zero.reduce import GradReducer


class Phase(enum.Enum):
    """The engine's phase, from root-level events only."""

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside a (nested) module output: tensors, tuples, lists, mappings, HF ModelOutputs, dataclasses."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type) and not isinstance(obj, Mapping):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name))
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from iter_tensors(value)
    elif isinstance(obj, (tuple, list)):
        for value in obj:
            yield from iter_tensors(value)


class PhaseMachine:
    """The phase state of one engine's groups and the transitions between phases (see module docstring)."""

    def __init__(
        self,
        groups: list[ShardedGroup],
        reducer: GradReducer,
        prefetcher: Prefetcher,
        events: list[tuple[str, str, str]] | None = None,
    ) -> None:
        self.groups = groups
        self.reducer = reducer
        self.prefetcher = prefetcher
        self.events = events
        self.phase = Phase.IDLE
        self.peak_gathered_bytes = 0  # high-water mark of gathered (ZeRO-3) parameter buffers
        self._kept: set[int] = set()  # groups held gathered from a forward for its backward
        self._delivered: set[tuple[int, int]] = set()  # (group, slot) of the gradients of this backward
        self._grad_forward = False  # the root forward ran with grad enabled: a backward may follow
        # Whether the last grad-enabled root forward was followed by a backward before the next root forward (the
        # step DeepSpeed's trace records): the reuse rule keeps groups for a backward only when one followed.
        self._backward_followed = True

    def _event(self, what: str, group: ShardedGroup) -> None:
        if self.events is not None:
            self.events.append((what, group.name, self.phase.value))

    # --- gathering ----------------------------------------------------------------------------------------------
    def use(self, group: ShardedGroup, kind: str) -> None:
        """Make ``group`` available now, after launching the prefetch the trace suggests."""
        upcoming = self.prefetcher.observe(group.index) if self.prefetcher.active_kind == kind else []
        if upcoming and self.prefetcher.enabled:
            self._prefetch(upcoming, group, kind)
        if group.state is not GroupState.GATHERED:
            self._event("gather", group)
        group.wait(kind)
        live = sum(
            g.numel * g.compute_dtype.itemsize
            for g in self.groups
            if not g.always_full and g.state is not GroupState.SHARDED
        )
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, live)

    def prefetch_ahead(self, kind: str) -> None:
        """At the start of a phase whose root has no group of its own to gather: launch the prefetch of the
        trace's first groups, as DeepSpeed's root pre-forward does. A hint: nothing waits on it here, and every
        gather it starts is owned by its group (drained at the phase end like any other)."""
        upcoming = self.prefetcher.upcoming() if self.prefetcher.active_kind == kind else []
        if upcoming and self.prefetcher.enabled:
            self._prefetch(upcoming, None, kind)

    def _prefetch(self, upcoming: list[int], current: ShardedGroup | None, kind: str) -> None:
        inflight = sum(g.numel for g in self.groups if g.state is GroupState.GATHERING)
        live = sum(g.numel for g in self.groups if g.state is not GroupState.SHARDED and not g.always_full)
        # the group needed now joins the batch when it is not in flight yet: one collective instead of two
        batch: list[ShardedGroup] = [current] if current is not None and current.state is GroupState.SHARDED else []
        for gid in upcoming:
            cand = self.groups[gid]
            if cand is current or cand.state is not GroupState.SHARDED or any(c is cand for c in batch):
                continue  # a trace may name a group twice (a module called twice): gather it once
            if inflight + cand.numel > self.prefetcher.bucket_elems:
                break
            if live + cand.numel > self.prefetcher.max_live_elems:
                break
            self._event("prefetch", cand)
            batch.append(cand)
            inflight += cand.numel
            live += cand.numel
        if len(batch) > (1 if batch and batch[0] is current else 0):
            start_gathers(batch, kind, batch[0].comm)  # one collective for the whole prefetch batch

    def release(self, group: ShardedGroup) -> None:
        """Release ``group`` if it holds anything and no ``GatheredParameters`` block pins it."""
        if not group.always_full and group.pins == 0 and group.state is not GroupState.SHARDED:
            self._event("release", group)
            group.release()

    def end_phase(self, keep: set[int] | None = None) -> None:
        """Drain and release everything (but the groups in ``keep``, held for the backward that follows); close the
        prefetch trace. Safe to call at any time."""
        self._kept = set(keep or ())
        for group in self.groups:
            if group.index not in self._kept:
                self.release(group)
        self.prefetcher.end()
        self.phase = Phase.IDLE

    def abort(self) -> None:
        """After an exception inside backward: complete and drop every reduction and partial gradient, drop the
        hpZ secondaries, release everything. The engine is quiescent again (the failed micro-step contributes
        nothing beyond what was already reduced)."""
        self.reducer.abort()
        self._delivered = set()
        for group in self.groups:
            group.take_grad_full()
            group.drop_secondary()
        self.end_phase()

    def _keep_for_backward(self, group: ShardedGroup) -> bool:
        """DeepSpeed's reuse rule across the forward→backward boundary: keep a group gathered if (by the valid
        forward trace) its backward use comes within ``stage3_max_reuse_distance`` elements of other groups, or
        within the prefetch bucket (``stage3_prefetch_bucket_size``: DeepSpeed's prefetcher, scanning the trace
        ahead, leaves gathered what it would fetch again; :attr:`Prefetcher.keep_distance`), and the live total
        stays within ``stage3_max_live_parameters`` -- and only when the previous grad-enabled root
        forward was followed by a backward (DeepSpeed's trace is one recorded step: after forwards without a
        backward it holds no backward use, so nothing is kept). A hint like prefetch: values are identical."""
        if not self._backward_may_follow() or not self._backward_followed or group.always_full:
            return False
        distance = self.prefetcher.distance_to_end(lambda gid: self.groups[gid].numel)
        if distance is None or distance >= self.prefetcher.keep_distance:  # both 0 turn the rule off
            return False
        live = sum(g.numel for g in self.groups if not g.always_full and g.state is not GroupState.SHARDED)
        return live <= self.prefetcher.max_live_elems

    def _note_root_forward(self) -> None:
        """At the start of a root forward: a grad-enabled root forward before this one that no backward followed
        turns the reuse rule off until a backward comes (:meth:`_note_backward`)."""
        if self._grad_forward:
            self._backward_followed = False
            self._kept = set()  # held for a backward that did not come: released at this forward's end
        self._grad_forward = torch.is_grad_enabled()

    def _note_backward(self) -> None:
        """At the start of a backward: the root forward before it was followed by one."""
        self._backward_followed = True
        self._grad_forward = False

    def _backward_may_follow(self) -> bool:
        """Whether a block's forward may be recomputed or differentiated by a backward: grad is on here, or the root
        forward ran with grad on and this block runs inside a reentrant activation checkpoint (which runs its
        forward under ``no_grad`` and repeats it in the backward, where it must find the hpZ secondary)."""
        return torch.is_grad_enabled() or (self.phase is Phase.FORWARD and self._grad_forward)

    # --- checks -------------------------------------------------------------------------------------------------
    def release_held(self) -> None:
        """Back to rest between phases: release groups a grad-enabled forward kept gathered for a backward that has
        not come, and rebind an evicted persistent group (no-op otherwise)."""
        if self.phase is Phase.IDLE:
            self.end_phase()
        self.restore_whole()

    def restore_whole(self) -> None:
        """Rebind persistent groups that ``empty_partition_cache`` evicted, from their whole masters. Rank-local
        (no collective), so it is safe on any subset of ranks at any point."""
        for group in self.groups:
            if group.replicated and group.state is GroupState.SHARDED:
                group.wait("forward")

    def assert_quiescent(self) -> None:
        """Raise if anything is gathered (but always-whole groups), pending or unreduced."""
        if not self.is_quiescent():
            raise AssertionError(f"engine is not quiescent: {self.describe()}")

    def is_quiescent(self) -> bool:
        """IDLE, nothing gathered but always-whole groups, nothing pending, nothing unreduced."""
        return self.phase is Phase.IDLE and self.reducer.is_quiescent() and all(g.is_quiescent() for g in self.groups)

    def describe(self) -> str:
        """Human-readable state, for assertion messages."""
        parts = [f"phase={self.phase.value}", f"reducer_quiescent={self.reducer.is_quiescent()}"]
        parts += [
            f"{g.name}:{g.state.value}{'+handle' if g.handle else ''}{'+grad' if g.grad_full is not None else ''}"
            for g in self.groups
        ]
        return ", ".join(parts)

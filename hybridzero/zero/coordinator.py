"""Phase tracking and hooks: when each gather group is gathered, released and reduced.

Phases come from the engine's own root-level events::

    IDLE --root pre-forward--> FORWARD --root post-forward (always, also on exceptions)--> IDLE
    IDLE --first pre-backward hook or gradient--> BACKWARD --autograd end-of-backward callback--> IDLE

* FORWARD: a block's group is gathered in the block's pre-forward hook (launching prefetch hints) and released in
  its post-forward hook (unless the trace says it is reused soon); the root group stays gathered for the whole root
  forward. With grad enabled, hooks on the outputs re-gather the group when its gradients start flowing back.
* End of FORWARD (``no_grad`` or not, train or eval): every group except the persistent one is drained and
  released; prefetch never crosses a phase end. Backward re-gathers what it needs — except groups the valid
  forward trace says are reused within ``stage3_max_reuse_distance`` (and fit ``stage3_max_live_parameters``):
  with grad enabled those stay gathered for the backward (DeepSpeed's reuse rule), and the next phase end that is
  not a grad-enabled forward (the end of backward, a ``no_grad`` forward, a step) releases them. As in DeepSpeed,
  whose trace is one recorded step, the rule applies only while the previous grad-enabled root forward was
  followed by a backward: after forwards without one (validation with grad on) every group is released at the end
  of the forward, until a backward comes again.
* Outside a root forward (IDLE), a block or a root-group module called directly (``generate`` helpers, a critic's
  value method, ``get_input_embeddings()(ids)``) gathers its group for that call and releases it after; with grad
  enabled its outputs get the same pre-backward hooks, so such calls train correctly too.
* BACKWARD: a group's flat gradient is reduced as soon as all its trainable parameters have their gradients;
  groups without frozen parameters are released then, block groups with frozen ones (LoRA: the frozen base) when
  the gradient of the block's input is complete (the backward has left the block). At the end every remaining
  gradient is reduced, every reduction completed and every group released. Forward hooks firing inside BACKWARD
  (activation-checkpoint recomputation) only make sure the group is gathered.

* A root forward that raises (also ``engine.module(...)`` or ``engine.module.generate(...)`` called directly, which no
  engine guard wraps) ends its phase as usual and then fails the group (:meth:`Comm.fail`): peers waiting in the
  gathers this rank will never issue raise ``PeerFailure`` instead of waiting for the timeout.

After each phase end :meth:`ZeroCoordinator.is_quiescent` holds (checked by ``engine.assert_quiescent()``).

The phase state and its transitions (``use``, ``release``, ``end_phase``, ``abort``, the quiescence checks) live in
the base class :class:`~hybridzero.zero.phases.PhaseMachine`; this module holds the hooks that drive them from the
module's events. ``Phase`` and ``iter_tensors`` are re-exported here.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hybridzero.zero.external import external_parameters
from hybridzero.zero.groups import GroupState, ShardedGroup
from hybridzero.zero.phases import Phase, PhaseMachine, iter_tensors
from hybridzero.zero.prefetch import Prefetcher
from hybridzero.zero.reduce import GradReducer

__all__ = ["Phase", "UnusedParametersError", "ZeroCoordinator", "iter_tensors"]


class UnusedParametersError(AssertionError, RuntimeError):
    """A backward left trainable parameters without a gradient while ``zero_optimization.ignore_unused_parameters``
    is false (stages 1/2). An ``AssertionError``, the type DeepSpeed raises (its tests catch that), and a
    ``RuntimeError`` as before; the message names the parameters and the key."""


class ZeroCoordinator(PhaseMachine):
    """Owns the hooks on one module and drives its groups through the phases."""

    def __init__(
        self,
        module: nn.Module,
        groups: list[ShardedGroup],
        reducer: GradReducer,
        prefetcher: Prefetcher,
        events: list[tuple[str, str, str]] | None = None,
        check_unused: bool = False,
    ) -> None:
        super().__init__(groups, reducer, prefetcher, events)
        self.module = module
        # ``ignore_unused_parameters: false`` (DeepSpeed, stages 1/2): a trainable parameter without a gradient at
        # the end of a backward is an error (``_delivered`` holds the gradients of this backward).
        self.check_unused = check_unused
        self._depth = 0
        self._implicit = 0  # nesting depth of root-group modules called outside a root forward
        self.bypass = False  # hybrid generation: everything is gathered and pinned; hooks do nothing
        self._in_flight_before: BaseException | None = None  # exception being handled when the root forward began
        self._handles: list[RemovableHandle] = []
        self._forward_handles: list[RemovableHandle] = []  # the module forward (pre-)hooks among ``_handles``
        self._restore_handles: list[RemovableHandle] = []  # while the persistent group is evicted (evict_whole)
        self._root = next((g for g in groups if g.owner == ""), None)
        self._timer = reducer.comm.ledger.timer  # the step profile: every hook body is a "hooks" region
        self._install(module)

    # --- installation -------------------------------------------------------------------------------------------
    def _install(self, module: nn.Module) -> None:
        modules = dict(module.named_modules())
        timed = self._timed
        self._hook_forward(module, self._root_pre_forward, self._root_post_forward, always_call=True)
        for group in self.groups:
            if group.owner:
                self._hook_forward(modules[group.owner], self._block_pre_hook(group), self._block_post_hook(group))
            for i, slot in enumerate(group.slots):
                if slot.trainable:
                    hook = timed(self._grad_hook(group, i))
                    self._handles.append(slot.param.register_post_accumulate_grad_hook(hook))
        if self._root is not None:
            root_params = {id(slot.param) for slot in self._root.slots}
            for sub in module.modules():
                used = [*sub.parameters(recurse=False), *external_parameters(sub)]  # its own, and registered ones
                if sub is not module and any(id(p) in root_params for p in used):
                    self._hook_forward(sub, self._entry_pre_hook, self._entry_post_hook, always_call=True)

    def _hook_forward(
        self, sub: nn.Module, pre: Callable[..., Any], post: Callable[..., Any], always_call: bool = False
    ) -> None:
        """Register ``pre``/``post`` (timed) as ``sub``'s forward pre-hook and forward hook."""
        handles = [
            sub.register_forward_pre_hook(self._timed(pre)),
            sub.register_forward_hook(self._timed(post), always_call=always_call),
        ]
        self._handles += handles
        self._forward_handles += handles

    def forward_hooks(self) -> list[RemovableHandle]:
        """The module forward hooks that fetch and release parameters, as in effect now: none while bypassed (a
        gather-once generation block) or after :meth:`remove_hooks`."""
        return [] if self.bypass else list(self._forward_handles)

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` with its body charged to the step profile's "hooks" region (a no-op context while it is off)."""
        region = self._timer.region

        def hook(*args: Any) -> Any:
            with region("hooks"):
                return fn(*args)

        return hook

    def remove_hooks(self) -> None:
        """Detach from the module (after draining; an evicted persistent group rebound); the module keeps its
        current parameter views."""
        self.end_phase()
        self.restore_whole()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._forward_handles.clear()

    # --- the persistent group's eviction (empty_partition_cache) ----------------------------------------------
    def evict_whole(self) -> None:
        """DeepSpeed's ``empty_partition_cache`` frees persistent parameters too: when quiescent, turn the unpinned
        persistent group's parameters into size-0 placeholders (its whole master stays). Every path that runs the
        model or reads it brings them back first (:meth:`restore_whole`, rank-local): the root forward, a backward,
        ``release_held`` (step, checkpoint, generation, weight sync), ``wait`` (``GatheredParameters``, state
        dicts), and, until then, a forward pre-hook on each module holding one of them (called directly)."""
        if not self.is_quiescent() or self.bypass:
            return
        evicted = [g for g in self.groups if g.replicated and g.pins == 0 and g.state is GroupState.GATHERED]
        for group in evicted:
            group.evict()
        owned = {id(slot.param) for group in evicted for slot in group.slots}
        if not owned or self._restore_handles:
            return
        for sub in self.module.modules():
            if any(id(p) in owned for p in sub.parameters(recurse=False)):
                self._restore_handles.append(sub.register_forward_pre_hook(self._restore_pre_hook))

    def _restore_pre_hook(self, module: nn.Module, args: Any) -> None:
        if not self.bypass:
            self.restore_whole()

    def restore_whole(self) -> None:
        """Rebind an evicted persistent group and drop the pre-hooks that waited for it."""
        super().restore_whole()
        for handle in self._restore_handles:
            handle.remove()
        self._restore_handles.clear()

    # --- forward hooks ------------------------------------------------------------------------------------------
    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        if self.bypass:
            return
        if self.phase is Phase.BACKWARD:
            if self._root is not None:
                self._root.wait("backward")
            return
        self._depth += 1
        if self._depth == 1:
            self.restore_whole()
            self.phase = Phase.FORWARD
            self.prefetcher.begin("forward")
            self._in_flight_before = sys.exc_info()[1]  # forward called inside an ``except`` block: not ours
            self._note_root_forward()
        if self._root is not None:
            self.use(self._root, "forward")
        elif self._depth == 1:
            self.prefetch_ahead("forward")

    def _root_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.bypass:
            return
        if self.phase is Phase.BACKWARD:
            return
        self._depth = max(0, self._depth - 1)
        if self._depth > 0:
            return
        raised = sys.exc_info()[1]  # set while torch runs this always-called hook for a forward that raised
        try:
            keep = set(self._kept)
            if self._root is not None and output is not None:
                self._attach_pre_backward(self._root, output)
                if self._keep_for_backward(self._root):
                    keep.add(self._root.index)
                elif torch.is_grad_enabled():
                    self._root.build_secondary()
            self.end_phase(keep if torch.is_grad_enabled() else None)
        finally:
            if raised is not None and raised is not self._in_flight_before:
                # The forward raised on this rank: peers are (or will be) in collectives this rank skipped, also
                # when the module was called directly (``module.generate`` under the hooks). Tear the group down so
                # they raise PeerFailure now instead of waiting for the timeout.
                self.reducer.comm.fail(raised)

    def _block_pre_hook(self, group: ShardedGroup) -> Callable[[nn.Module, Any], Any]:
        def hook(module: nn.Module, args: Any) -> Any:
            if self.bypass:
                return None
            if self.phase is Phase.BACKWARD:
                group.wait("backward")  # activation-checkpoint recomputation
                return None
            self.use(group, "forward")
            return self._with_post_backward(group, args)

        return hook

    def _block_post_hook(self, group: ShardedGroup) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.bypass or self.phase is Phase.BACKWARD:
                return
            self._attach_pre_backward(group, output)
            if self._keep_for_backward(group):
                self._kept.add(group.index)  # backward reuses it within the reuse distance: no re-gather
                return
            if self._backward_may_follow():
                group.build_secondary()  # hpZ: backward will gather this node-locally
            if not self.prefetcher.reused_soon(group.index, lambda gid: self.groups[gid].numel):
                self.release(group)

        return hook

    # --- entry points outside the root forward --------------------------------------------------------------------
    def _entry_pre_hook(self, module: nn.Module, args: Any) -> None:
        """A root-group module called directly (``get_input_embeddings()(ids)``, a value head, ...): gather the root
        group for the call. Inside a root forward or a backward this is a no-op."""
        if self.bypass or self.phase is not Phase.IDLE or self._root is None:
            return
        self._implicit += 1
        if self._root.state is not GroupState.GATHERED:
            self._event("gather", self._root)
        self._root.wait("forward")

    def _entry_post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.bypass or self.phase is not Phase.IDLE or self._root is None or self._implicit == 0:
            return
        if output is not None:
            self._attach_pre_backward(self._root, output)
        self._implicit -= 1
        if self._implicit == 0:
            self.release(self._root)

    # --- backward hooks -----------------------------------------------------------------------------------------
    def _attach_pre_backward(self, group: ShardedGroup, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        for t in iter_tensors(output):
            if t.requires_grad:
                t.register_hook(self._timed(self._pre_backward_hook(group)))

    def _with_post_backward(self, group: ShardedGroup, args: Any) -> tuple[Any, ...] | None:
        """A group with frozen parameters cannot be released when its gradients are reduced (frozen weights are
        still read to form input gradients); it is released when the gradient of the block's input is complete,
        i.e. the backward has left the block (DeepSpeed's post-backward function on module inputs). The positional
        tensor inputs that require grad are replaced by identity views carrying the hook, so it fires before the
        previous block's pre-backward hook on the same tensor (one block gathered at a time, as in the forward).
        Without such an input the group stays gathered until the end of the backward. Returns the new args or
        None (unchanged)."""
        if not group.has_frozen or not torch.is_grad_enabled() or not isinstance(args, tuple):
            return None
        if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return None
        out = []
        for a in args:
            if isinstance(a, torch.Tensor) and a.requires_grad:
                a = a.view_as(a)
                a.register_hook(self._timed(self._post_backward_hook(group)))
            out.append(a)
        return tuple(out)

    def _post_backward_hook(self, group: ShardedGroup) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            delivered = all(
                (group.index, i) in self._delivered for i, slot in enumerate(group.slots) if slot.trainable
            )  # released before a gradient arrived would break its accumulation
            if self.phase is Phase.BACKWARD and delivered and group.grad_full is None:
                self.release(group)

        return hook

    def _pre_backward_hook(self, group: ShardedGroup) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self._begin_backward()
            self.use(group, "backward")

        return hook

    def _begin_backward(self) -> None:
        if self.phase is Phase.BACKWARD:
            return
        if self.phase is Phase.FORWARD:
            self.end_phase()
        self.restore_whole()  # evicted after the forward: its gradients accumulate into whole parameters
        self._note_backward()
        self.phase = Phase.BACKWARD
        self.prefetcher.begin("backward")
        torch.autograd.Variable._execution_engine.queue_callback(self._timed(self._end_backward))

    def _grad_hook(self, group: ShardedGroup, slot_index: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            self._begin_backward()
            grad, param.grad = param.grad, None
            assert grad is not None
            self._delivered.add((group.index, slot_index))
            if group.accept_grad(slot_index, grad):
                full = group.take_grad_full()
                assert full is not None  # accept_grad returned True: the group's gradient buffer is complete
                self.reducer.submit(group, full)
                if not group.has_frozen:
                    self.release(group)

        return hook

    def _end_backward(self) -> None:
        unused = self._unused_parameters()
        for group in self.groups:
            full = group.take_grad_full() if group.grad_full is not None else None
            if full is not None:
                self.reducer.submit(group, full)
        self.reducer.drain()
        for group in self.groups:
            group.drop_secondary()  # consumed: the next forward builds fresh ones
        self.end_phase()
        if self.check_unused:
            # After the collectives completed (every rank quiescent), agreed with one all_gather_object: any rank's
            # unused parameters raise on every rank together, so the error is not a group failure and the engine
            # stays usable (a caller may catch it).
            error = None
            if unused:
                error = UnusedParametersError(
                    f"{len(unused)} trainable parameter(s) got no gradient in this backward: {', '.join(unused)}; "
                    "zero_optimization.ignore_unused_parameters is false, so this is an error (as in DeepSpeed). Set "
                    "it to true (the default) if parts of the model are unused on purpose, or freeze those parameters"
                )
            self.reducer.comm.agree(error, "backward", phase="backward")

    def _unused_parameters(self) -> list[str]:
        """Names of trainable parameters with no gradient in this backward (only when checking); resets the record."""
        delivered, self._delivered = self._delivered, set()
        if not self.check_unused:
            return []
        return [
            slot.spec.name
            for group in self.groups
            for i, slot in enumerate(group.slots)
            if slot.trainable and (group.index, i) not in delivered
        ]

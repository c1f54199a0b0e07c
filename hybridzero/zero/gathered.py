"""``GatheredParameters``: full parameters inside a ``with`` block, DeepSpeed's engine-free API.

The owner of a parameter is found through :data:`hybridzero.zero.registry.REGISTRY` (an engine registers its
:class:`ZeroParamOwner` when it is built; a ``zero.Init`` context registers itself during construction). Parameters
nobody owns are ordinary whole tensors: for them the block is a no-op (DeepSpeed's behaviour before ``initialize``).
Parameters of several owners in one call are handled owner by owner, in order of first appearance (the same order
on every rank), each owner's block nested inside the previous one's.

Semantics of one owner's block (:meth:`ZeroParamOwner.gathered`):

* On entry every group holding one of ``params`` is gathered and pinned: forwards inside the block do not release
  it. Always-whole groups (persistent, stages 0–2) are already full.
* On exit with ``modifier_rank=r`` each affected group's full buffer is broadcast from rank ``r`` and the values of
  exactly the named parameters are written into the master through :meth:`ShardedGroup.absorb_full`, the one
  write path (so every derived copy — compute shard, whole buffers, the hpZ secondary — is refreshed).
* On exit without a modifier a content checksum of the named parameters taken on entry is compared on exit and the
  ranks agree (one all-reduce) on whether any of them edited. An edit that leaves the named parameters identical on
  every rank (their checksums agree: a second all-reduce) is kept, as with ``modifier_rank=0`` — the case of code
  that computes the same update from the gathered values on every rank, as DeepSpeed-Chat's ZeRO-3 EMA
  (``param_ema.data.copy_(torch.lerp(...))``; DeepSpeed discards that write to partitioned parameters silently,
  its version check does not see ``.data`` writes). Any other edit is an error raised on every rank (DeepSpeed's
  sanity check), after every rank restored the values from the master — never a silent discard on some ranks and
  a silent divergence on others.

Every rank must enter and leave the block together (the gathers, broadcasts and the agreement are collectives).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from types import TracebackType
from typing import Protocol, cast

import torch
from torch import nn

from hybridzero.comm.collectives import Comm
from hybridzero.zero.checksum import content_checksum
from hybridzero.zero.coordinator import ZeroCoordinator
from hybridzero.zero.groups import GroupState, ShardedGroup, Slot
from hybridzero.zero.registry import REGISTRY, ParamOwner

__all__ = ["GatheredParameters", "HasParamOwner", "ZeroParamOwner", "content_checksum"]

_PHASE = "gathered_parameters"


def _slots_checksum(group: ShardedGroup, slots: Sequence[Slot]) -> torch.Tensor:
    assert group.full is not None
    return sum(
        (content_checksum(group.full[s.spec.offset : s.spec.end]) for s in slots),
        torch.zeros(2, dtype=torch.int64, device=group.device),
    )


class ZeroParamOwner:
    """The coordinator-side owner of one engine's parameters: what ``GatheredParameters`` and the tensor-fragment
    API (``hybridzero.utils``) need, and nothing of the engine.

    Invariant: maps exactly the parameter objects of ``coordinator.groups``' slots (by identity) to their group and
    slot; the slots hold the parameters alive, so the identities stay valid for the owner's lifetime.
    """

    def __init__(self, coordinator: ZeroCoordinator, comm: Comm) -> None:
        self.coordinator = coordinator
        self.comm = comm
        self._where: dict[int, tuple[ShardedGroup, Slot]] = {
            id(slot.param): (group, slot) for group in coordinator.groups for slot in group.slots
        }

    @property
    def groups(self) -> list[ShardedGroup]:
        """The gather groups, in order."""
        return self.coordinator.groups

    def params(self) -> list[nn.Parameter]:
        """Every parameter this owner shards (each once)."""
        return [slot.param for group in self.groups for slot in group.slots]

    def owns(self, param: torch.Tensor) -> bool:
        """True if ``param`` is one of this owner's parameters (by identity)."""
        hit = self._where.get(id(param))
        return hit is not None and hit[1].param is param

    def locate(self, param: torch.Tensor) -> tuple[ShardedGroup, Slot]:
        """The group and slot of ``param``; ``ValueError`` if this owner does not shard it."""
        if not self.owns(param):
            raise ValueError(f"parameter of shape {tuple(param.shape)} does not belong to this engine's module")
        return self._where[id(param)]

    def touched(self, params: Sequence[torch.Tensor]) -> list[tuple[ShardedGroup, list[Slot]]]:
        """``(group, slots of params)`` for every group holding one of ``params``, in group order."""
        wanted = {id(p) for p in params}
        touched = [(g, [s for s in g.slots if id(s.param) in wanted]) for g in self.groups]
        return [(g, slots) for g, slots in touched if slots]

    def check_not_gathered(self, group: ShardedGroup, what: str) -> None:
        """Writes to the master of a ZeRO-3 group need it released (its gathered buffer would go stale)."""
        if not group.always_full and group.state is not GroupState.SHARDED:
            raise RuntimeError(
                f"{what}: group '{group.name}' is gathered (inside a forward or a GatheredParameters "
                f"block); call it outside, or edit inside GatheredParameters(..., modifier_rank=r)"
            )

    def each_gathered(self, phase: str) -> Iterator[ShardedGroup]:
        """Every group in order, each gathered (and pinned) while it is current and released after unless it was
        gathered before: at most one ZeRO-3 group is held by this at a time. Consume it to the end (or close it)."""
        for group in self.groups:
            was = group.state is GroupState.GATHERED
            group.pins += 1
            try:
                group.wait(phase)
                yield group
            finally:
                group.pins -= 1
                if not was:
                    self.coordinator.release(group)

    @contextmanager
    def gathered(self, params: list[nn.Parameter], modifier_rank: int | None) -> Iterator[None]:
        """Full values of ``params`` inside the block (see the module docstring)."""
        touched = self.touched(params)
        found = {id(s.param) for _, slots in touched for s in slots}
        missing = [i for i, p in enumerate(params) if id(p) not in found]
        if missing:
            raise ValueError(
                f"GatheredParameters: parameters at positions {missing} do not belong to this engine's module"
            )
        if modifier_rank is not None and not 0 <= modifier_rank < self.comm.world_size:
            raise ValueError(
                f"GatheredParameters: modifier_rank={modifier_rank} is not a rank of a world of size "
                f"{self.comm.world_size} (valid: None or 0..{self.comm.world_size - 1})"
            )
        was_gathered = {g.index for g, _ in touched if g.state is GroupState.GATHERED}
        for group, _ in touched:
            group.pins += 1  # all pinned before any gather, so the exit never unpins what it did not pin
        sums: list[tuple[int, torch.Tensor]] | None = None
        body_failed = False
        try:
            for group, _ in touched:
                group.wait(_PHASE)
            if modifier_rank is None:
                sums = [(g.version, _slots_checksum(g, slots)) for g, slots in touched]
            yield
        except BaseException as exc:
            # The block's body failed on this rank; its peers may be inside their blocks or already waiting in the
            # exit's broadcasts. Fail the group (every peer's next collective raises PeerFailure naming this rank)
            # and leave without a collective: pairing the exit's broadcasts would let the peers carry on silently.
            body_failed = True
            self.comm.fail(exc)
            raise
        finally:
            self._exit(touched, modifier_rank, sums, was_gathered, failed=body_failed)

    def _exit(
        self,
        touched: list[tuple[ShardedGroup, list[Slot]]],
        modifier_rank: int | None,
        sums: list[tuple[int, torch.Tensor]] | None,
        was_gathered: set[int],
        failed: bool,
    ) -> None:
        """Unpin, write back (modifier) or check for unowned edits, release; after a failed body only the local
        part runs (no collective), and the group is already failed for every peer."""
        editors: list[int] = []
        with torch.no_grad():
            for group, _ in touched:
                group.pins -= 1
            if modifier_rank is not None and not failed:
                self._keep(touched, modifier_rank)
            elif sums is not None and not failed:
                editors = self._editors(touched, sums)
                if editors and self._same_on_every_rank(touched):
                    self._keep(touched, 0)  # the one edit every rank made (DeepSpeed-Chat's ZeRO-3 EMA update)
                    editors = []
                elif editors:
                    self._restore(touched, editors, was_gathered)
            for group, _ in touched:
                group.drop_secondary()  # a forward inside the block may have cached values that are gone now
                if group.index not in was_gathered:
                    self.coordinator.release(group)
        if editors and not failed:
            raise RuntimeError(
                f"GatheredParameters: in-place modification of parameters inside the block on rank(s) {editors} "
                f"without a modifier_rank, so the edit cannot be kept consistently; it was undone on every rank. Pass "
                f"modifier_rank=<the rank whose values to keep> (its values are broadcast to every rank)."
            )

    def _editors(
        self, touched: list[tuple[ShardedGroup, list[Slot]]], sums: list[tuple[int, torch.Tensor]]
    ) -> list[int]:
        """Ranks whose named parameters changed inside the block (agreed on by every rank: one all-reduce). A group
        whose master was written through ``write_shard`` inside the block (its version moved) changed legitimately."""
        mine = any(
            g.version == version and not torch.equal(_slots_checksum(g, slots), before)
            for (g, slots), (version, before) in zip(touched, sums)
        )
        flags = torch.zeros(self.comm.world_size, dtype=torch.float32, device=touched[0][0].device)
        flags[self.comm.rank] = float(mine)
        self.comm.all_reduce(flags, phase=_PHASE)
        return [r for r in range(self.comm.world_size) if flags[r] > 0]

    def _keep(self, touched: list[tuple[ShardedGroup, list[Slot]]], src: int) -> None:
        """Write the named parameters' values as rank ``src`` holds them into every rank's master."""
        for group, slots in touched:
            assert group.full is not None
            self.comm.broadcast(group.full, src, phase=_PHASE)
            group.absorb_full(slots)

    def _same_on_every_rank(self, touched: list[tuple[ShardedGroup, list[Slot]]]) -> bool:
        """Whether every rank holds the same values of the named parameters now (their checksums agree; one
        all-reduce of each rank's row). Every rank gets the same answer."""
        mine = torch.cat([_slots_checksum(g, slots) for g, slots in touched])
        rows = torch.zeros(self.comm.world_size, mine.numel(), dtype=torch.int64, device=mine.device)
        rows[self.comm.rank] = mine
        self.comm.all_reduce(rows, phase=_PHASE)
        return bool((rows == rows[0]).all())

    def _restore(
        self, touched: list[tuple[ShardedGroup, list[Slot]]], editors: list[int], was_gathered: set[int]
    ) -> None:
        """Undo an edit made without a modifier, identically on every rank: whole groups are re-derived from the
        master (a master the edit wrote through — fp32 whole groups — first from the lowest rank that did not
        edit); ZeRO-3 groups are dropped and, if they must stay gathered, gathered again from the shards."""
        clean = next((r for r in range(self.comm.world_size) if r not in editors), 0)
        for group, _ in touched:
            if group.always_full:
                if group.full is group.master:
                    self.comm.broadcast(group.master, clean, phase=_PHASE)
                group.write_shard()
            elif group.index in was_gathered:
                group.release()
                group.wait(_PHASE)


class HasParamOwner(Protocol):
    """What ``GatheredParameters(..., engine=...)`` needs of an engine (kept for compatibility)."""

    @property
    def param_owner(self) -> ParamOwner:
        """The owner of the engine's parameters."""
        ...


def _as_list(params: torch.Tensor | Iterable[torch.Tensor] | None) -> list[nn.Parameter]:
    if params is None:
        return []
    if isinstance(params, torch.Tensor):
        return [cast(nn.Parameter, params)]
    return [cast(nn.Parameter, p) for p in params if p is not None]


class GatheredParameters:
    """``with GatheredParameters(params, modifier_rank=None, fwd_module=None, enabled=True):`` — DeepSpeed's
    signature; see the module docstring. ``fwd_module`` is accepted for compatibility and unused (hybridzero needs
    no external-parameter registration). ``engine=`` names the owner explicitly (older hybridzero code); then every
    parameter must belong to it."""

    def __init__(
        self,
        params: torch.Tensor | Iterable[torch.Tensor] | None,
        modifier_rank: int | None = None,
        fwd_module: nn.Module | None = None,
        enabled: bool = True,
        *,
        engine: HasParamOwner | None = None,
    ) -> None:
        self.params = _as_list(params)
        self.modifier_rank = modifier_rank
        self.fwd_module = fwd_module
        self.enabled = enabled
        self.engine = engine
        self._stack: ExitStack | None = None

    def _by_owner(self) -> list[tuple[ParamOwner, list[nn.Parameter]]]:
        if self.engine is not None:
            return [(self.engine.param_owner, self.params)] if self.params else []
        order: list[ParamOwner] = []
        by_owner: dict[int, list[nn.Parameter]] = {}
        for p in self.params:
            owner = REGISTRY.owner_of(p)
            if owner is None:
                continue  # nobody shards it: already whole
            if id(owner) not in by_owner:
                order.append(owner)
                by_owner[id(owner)] = []
            by_owner[id(owner)].append(p)
        return [(owner, by_owner[id(owner)]) for owner in order]

    def __enter__(self) -> None:
        if not self.enabled:
            return
        stack = ExitStack()
        try:
            for owner, params in self._by_owner():
                context: AbstractContextManager[None] = owner.gathered(params, self.modifier_rank)
                stack.enter_context(context)
        except BaseException:
            stack.close()
            raise
        self._stack = stack

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        stack, self._stack = self._stack, None
        if stack is None:
            return None
        return stack.__exit__(exc_type, exc, tb)

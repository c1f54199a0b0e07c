"""A rank that leaves Hugging Face's synced generation with an exception cannot strand its peers.

Under ZeRO-3 at world > 1 the engine marks its module as sharded, so a bare ``engine.module.generate(...)`` runs HF's
*synced* generation: before every decode step each rank all-reduces a "still generating" flag (a float32 scalar,
SUM, default group) with a raw ``torch.distributed`` call that no poll can watch. An exception raised between two
forwards on one rank (a logits processor, a stopping criterion, a streamer) unwinds that rank out of ``generate``
while its peers wait in the next flag all-reduce: without this guard they wait until the process group's timeout.
(An exception *inside* a forward is the coordinator's: it fails the group, and the peers' gathers report it.)

:class:`SyncedGenerationGuard` makes the abandonment visible at the failing rank's next collective, with one float32
scalar exchange (``all_reduce`` SUM on the engine's world group, through :class:`~hybridzero.comm.Comm`, so it pairs
with HF's flag when it has to):

* every forward of a generation (it carries an HF KV cache: ``cache`` / ``past_key_values``) starts with an
  exchange: ``SYNC`` if it continues the generation this rank is in (the same cache object, at the length this
  rank's last forward left it), ``CLOSE`` if it starts a new one;
* after a generation forward the rank *owes* a ``CLOSE``: the next collective of any other kind (a training forward,
  a step, a save, ...) issues it first (``FailureState.owed``).

Every rank contributes one value class: HF's flag (0 or 1), ``SYNC = B``, ``CLOSE = B**2``, ``RESOLVE = B**3`` with
``B = world + 1``, so the sum tells how many ranks are in each class (:func:`decode`; exact in float32 while
``world * B**3 < 2**24``, i.e. world <= 63 -- larger worlds run without the guard, as before). Ranks in step always
agree (all ``SYNC`` or all ``CLOSE``): that costs one 4-byte all-reduce per decode step and one per generation. Any
mixture means a rank left a generation its peers are still in:

* a peer that was waiting in HF's flag all-reduce (its class is missing from the sum) saw a non-zero sum, so HF runs
  its next forward, whose exchange must be paired: every other rank joins one more exchange as ``RESOLVE``;
* then every rank raises :class:`GenerationDesync` at the same collective, recorded as *agreed*: the process group
  stays usable and every rank's raw collectives stay paired (the abandoned generation's flags were matched by the
  failing rank's exchanges). The peers lose that generation's output; nothing else changes.

Invariant: between two collectives of the engine, a rank that ran a generation forward either continues that
generation or closes it before anything else; no rank issues a collective its peers cannot pair.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch
from torch import nn

from hybridzero.comm.collectives import Comm
from hybridzero.zero.coordinator import Phase, ZeroCoordinator

_FLOAT32_EXACT = 2**24


class GenerationDesync(RuntimeError):
    """A rank left a synced (ZeRO-3) generation with an exception while its peers were still in it. Raised on every
    rank at the same collective; the process group stays usable."""


def guard_fits(world_size: int) -> bool:
    """Whether the four value classes of a ``world_size`` exchange stay exact in float32 (see module docstring)."""
    base = world_size + 1
    return 1 < world_size and world_size * base**3 < _FLOAT32_EXACT


def values(world_size: int) -> dict[str, float]:
    """The value each role contributes to an exchange (HF's flag contributes 0.0 or 1.0)."""
    base = world_size + 1
    return {"sync": float(base), "close": float(base**2), "resolve": float(base**3)}


def decode(total: float, world_size: int) -> dict[str, int]:
    """How many ranks contributed each class to an exchange's sum. ``flagged`` are the ranks that were in HF's flag
    all-reduce instead of an exchange. Pure."""
    base, n = world_size + 1, int(total)
    if n != total or n < 0:
        raise ValueError(f"exchange sum {total} is not a non-negative integer: the world size is too large")
    counts = {"resolve": n // base**3, "close": n // base**2 % base, "sync": n // base % base}
    counts["flagged"] = world_size - sum(counts.values())
    return counts


class SyncedGenerationGuard:
    """Installed by the engine on a ZeRO-3 module at 1 < world <= 63 (hooks on the module root, ahead of the
    coordinator's). Owns the generation this rank is in: the KV cache it uses and the next cache position."""

    def __init__(self, module: nn.Module, comm: Comm, coordinator: ZeroCoordinator, device: torch.device) -> None:
        self.comm, self.coordinator, self.device = comm, coordinator, device
        self.values = values(comm.world_size)
        self._cache: weakref.ref[Any] | None = None
        self._length = -1  # the cache's length after this rank's last generation forward
        self._active = False  # this forward is a generation forward (set by the pre-hook, read by the post-hook)
        self._handles = [
            module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True),
            module.register_forward_hook(self._post_forward, always_call=True),
        ]

    def remove(self) -> None:
        """Detach the hooks."""
        for handle in self._handles:
            handle.remove()

    def _pre_forward(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        self._active = False
        coord = self.coordinator
        if coord.bypass or coord.phase is Phase.BACKWARD or coord.phase is Phase.FORWARD:
            return  # full-mode generation, a recomputation, or a nested call of the root
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # transformers 5 passes ``cache``
        if cache is None or not callable(getattr(cache, "get_seq_length", None)):
            return  # not a generation forward: an owed close (if any) goes first at the next collective
        continuing = self._cache is not None and self._cache() is cache and cache_length(cache) == self._length
        self.comm.failures.owed = None  # this exchange is the one owed
        self._exchange("sync" if continuing else "close")
        self._cache, self._active = _weak(cache), True

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._active and sys.exc_info()[1] is None and self._cache is not None:
            cache = self._cache()
            self._length = cache_length(cache) if cache is not None else -1
            self.comm.failures.owed = self._close  # before any other collective, unless generation continues
        self._active = False

    def _close(self) -> None:
        self._cache, self._length = None, -1
        self._exchange("close")

    def _exchange(self, role: str) -> None:
        """One exchange; raises :class:`GenerationDesync` (agreed) on every rank unless all ranks are in step."""
        counts = self._all_reduce(self.values[role])
        world = self.comm.world_size
        if counts["sync"] == world or counts["close"] == world:
            return
        self._cache, self._length = None, -1
        if counts["flagged"]:  # they now run a forward whose exchange we pair, as RESOLVE so nobody sees "in step"
            self._all_reduce(self.values["resolve"])
        error = GenerationDesync(
            f"rank {self.comm.rank}: a synced ZeRO-3 generation was left by an exception on some rank while its "
            f"peers were still generating (exchange: {counts}); every rank raises this here and the process group "
            "stays usable, but that generation's output is lost. Catch exceptions inside the generation callback, "
            "or use engine.generate (the hybrid engine) whose full mode exchanges nothing while decoding."
        )
        self.comm.failures.agreed = error
        raise error

    def _all_reduce(self, value: float) -> dict[str, int]:
        flag = torch.tensor(value, dtype=torch.float32, device=self.device)  # HF's flag: a float32 scalar
        self.comm.all_reduce(flag, phase="generate_sync")
        return decode(float(flag.item()), self.comm.world_size)


def cache_length(cache: Any) -> int:
    """Tokens held by an HF KV cache (``Cache.get_seq_length``)."""
    return int(cache.get_seq_length())


def _weak(obj: Any) -> weakref.ref[Any] | None:
    """A weak reference to a KV cache (or None for an object that does not support one: then every forward of that
    generation counts as a new one, which is still safe, only one class less precise)."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return None

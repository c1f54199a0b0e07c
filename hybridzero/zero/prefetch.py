"""Trace-based prefetch: a hint that can never change a result or strand a gather.

For each phase kind ("forward", "backward") the order in which gather groups were used is recorded. While the
current phase follows the recorded trace, using group ``g`` at position ``p`` suggests the groups at ``p+1, …`` as
prefetch candidates; the coordinator launches gathers for them within the byte budgets, and every launched gather
is owned by its group's handle. The first deviation (generation, eval, another branch, a module called twice)
invalidates the trace for the rest of the phase: prefetch simply stops, nothing raises, nothing is skipped, and
the observed order becomes the trace next time.

Invariants: :meth:`Prefetcher.observe` is pure bookkeeping (it issues nothing); suggestions never cross a phase
end (``end()`` closes the phase, the coordinator drains every gather at phase end).
"""

from __future__ import annotations

from collections.abc import Callable


class Prefetcher:
    """Records use order per phase kind and suggests what to gather next."""

    def __init__(self, bucket_elems: int, max_live_elems: int, max_reuse_distance: int) -> None:
        self.bucket_elems = bucket_elems
        self.max_live_elems = max_live_elems
        self.max_reuse_distance = max_reuse_distance
        self.traces: dict[str, tuple[int, ...]] = {}
        self.invalidations = 0
        self._kind: str | None = None
        self._observed: list[int] = []
        self._valid = False

    @property
    def enabled(self) -> bool:
        """Whether prefetch may launch anything at all."""
        return self.bucket_elems > 0

    @property
    def active_kind(self) -> str | None:
        """The phase kind being observed, or None between phases."""
        return self._kind

    def begin(self, kind: str) -> None:
        """Start observing a phase of ``kind``."""
        self._kind = kind
        self._observed = []
        self._valid = kind in self.traces

    def observe(self, group_id: int) -> list[int]:
        """Record the use of ``group_id``; return the recorded continuation while the trace still matches."""
        if self._kind is None:
            return []
        pos = len(self._observed)
        self._observed.append(group_id)
        if not self._valid:
            return []
        trace = self.traces[self._kind]
        if pos < len(trace) and trace[pos] == group_id:
            return list(trace[pos + 1 :])
        self._valid = False
        self.invalidations += 1
        return []

    @property
    def keep_distance(self) -> int:
        """How close (elements of other groups) a group's next use must be for it to stay gathered across the
        forward→backward boundary: ``stage3_max_reuse_distance``, or the prefetch bucket when larger (DeepSpeed's
        prefetcher leaves gathered what it would fetch again within its bucket). 0 with both 0."""
        return max(self.max_reuse_distance, self.bucket_elems)

    def upcoming(self) -> list[int]:
        """The valid trace of the current phase when nothing of it is observed yet (pure; empty otherwise)."""
        if self._kind is None or not self._valid or self._observed:
            return []
        return list(self.traces[self._kind])

    def reused_soon(self, group_id: int, numel_of: Callable[[int], int]) -> bool:
        """True if the valid trace uses ``group_id`` again within ``max_reuse_distance`` elements of other groups."""
        if not self._valid or self._kind is None:
            return False
        trace = self.traces[self._kind]
        distance = 0
        for gid in trace[len(self._observed) :]:
            if gid == group_id:
                return True
            distance += numel_of(gid)
            if distance > self.max_reuse_distance:
                return False
        return False

    def distance_to_end(self, numel_of: Callable[[int], int]) -> int | None:
        """Elements of the distinct groups the valid trace still uses after the current position (None without a
        valid trace): how far away, in the backward that mirrors this forward, the current group's reuse is."""
        if not self._valid or self._kind is None:
            return None
        rest = set(self.traces[self._kind][len(self._observed) :])
        return sum(numel_of(gid) for gid in rest)

    def end(self) -> None:
        """Close the phase; a phase that deviated (or ended early) becomes the new trace."""
        if self._kind is None:
            return
        observed = tuple(self._observed)
        old = self.traces.get(self._kind)
        if old is not None and observed != old and self._valid:
            self.invalidations += 1  # ended before the trace did
        if observed:
            self.traces[self._kind] = observed
        self._kind = None
        self._observed = []
        self._valid = False

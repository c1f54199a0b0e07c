"""Exclusive wall-time accounting of one training step, by named region (the step profile).

A :class:`StepTimer` is owned by one engine's :class:`~hybridzero.comm.ledger.Ledger` (never global) and is off by
default. When on, code marks regions with ``with timer.region("copy.grad"): ...``; regions nest, and each moment of
wall time is charged to the *innermost* open region only, so the per-region totals never count a moment twice and
their sum is the wall time spent inside outermost regions. Region names are dotted; the first component is the
coarse kind of work (see :data:`KINDS`), e.g. ``compute.forward``, ``comm.all_gather`` (issuing a collective on this
thread), ``wait.all_gather`` (blocked until it completed), ``copy.pack``, ``hooks``.

Invariants:
* Off: ``region`` returns one shared no-op context (no clock read, nothing recorded).
* On: for any nesting, ``sum(totals.values())`` equals the wall time covered by outermost regions (up to float
  rounding), and a region's total is its elapsed time minus the elapsed time of the regions opened inside it.
* The clock is injectable (``clock``: tests drive it by hand; ``time.thread_time`` gives this thread's CPU time,
  which other processes on the same cores do not inflate); the default is ``time.perf_counter``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

KINDS: tuple[str, ...] = ("compute", "comm", "copy", "hooks", "wait")
"""Coarse kinds of work, the first component of a region name."""

_OFF = contextlib.nullcontext()


class StepTimer:
    """Per-region exclusive seconds (see module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.enabled = False
        self.totals: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.clock = clock
        self._stack: list[list[float]] = []  # per open region: [start, seconds spent in regions nested inside]

    def region(self, name: str) -> contextlib.AbstractContextManager[None]:
        """A context charging its exclusive wall time to ``name`` (a no-op while the timer is off)."""
        return self._timed(name) if self.enabled else _OFF

    @contextlib.contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        frame = [self.clock(), 0.0]
        self._stack.append(frame)
        try:
            yield
        finally:
            elapsed = self.clock() - frame[0]
            self._stack.pop()
            self.totals[name] = self.totals.get(name, 0.0) + (elapsed - frame[1])
            self.counts[name] = self.counts.get(name, 0) + 1
            if self._stack:
                self._stack[-1][1] += elapsed

    def reset(self) -> None:
        """Forget the totals (between measured steps). Open regions stay open."""
        self.totals.clear()
        self.counts.clear()

    def take(self) -> dict[str, float]:
        """The totals so far (a copy), then :meth:`reset`."""
        out = dict(self.totals)
        self.reset()
        return out


def by_kind(totals: dict[str, float]) -> dict[str, float]:
    """Fold region totals into :data:`KINDS` (first dotted component; unknown kinds are kept under their own
    name). Pure."""
    out = {kind: 0.0 for kind in KINDS}
    for name, seconds in totals.items():
        kind = name.split(".", 1)[0]
        out[kind] = out.get(kind, 0.0) + seconds
    return out

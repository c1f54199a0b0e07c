"""Ledger of collective calls and bytes.

Invariant: every collective the engine issues is recorded here exactly once, by the single wrapper in
``hybridzero.comm.collectives``; tests assert these counts against the theoretical values.

Two byte counts are kept per call:

* ``bytes``: the size of the collective's whole buffer (the gathered output of an all-gather, the full input of a
  reduce-scatter, the tensor of an all-reduce or broadcast). This is the "model bytes moved" view used by the ZeRO
  papers (3Ψ per step for ZeRO-3).
* ``wire_bytes``: what one rank sends on a ring algorithm: (W-1)/W of the buffer for all-gather and reduce-scatter,
  2(W-1)/W for all-reduce, the buffer for a broadcast root. 0 at world size 1.

The ledger also carries the engine's :class:`~hybridzero.comm.timing.StepTimer` (``ledger.timer``, off unless a
profile turns it on): every collective's issue and wait are timed regions of it, and the zero / optim layers mark
their copies, hooks and optimizer math through the same object (``bench/bench_profile.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from hybridzero.comm.timing import StepTimer


@dataclass
class LedgerEntry:
    """Counters for one (collective, group, phase) key."""

    calls: int = 0
    bytes: int = 0
    wire_bytes: int = 0


@dataclass(frozen=True)
class LedgerKey:
    """What a collective was, on which group, in which engine phase."""

    collective: str
    group: str
    phase: str


class Ledger:
    """Calls and bytes per (collective, group, phase). Owned by one engine; never global."""

    def __init__(self) -> None:
        self._entries: dict[LedgerKey, LedgerEntry] = {}
        self.timer = StepTimer()  # the step profile's regions (off by default)

    def record(self, collective: str, group: str, phase: str, nbytes: int, wire_bytes: int) -> None:
        """Add one call of ``collective`` moving ``nbytes`` (whole buffer) and ``wire_bytes`` (sent per rank)."""
        entry = self._entries.setdefault(LedgerKey(collective, group, phase), LedgerEntry())
        entry.calls += 1
        entry.bytes += int(nbytes)
        entry.wire_bytes += int(wire_bytes)

    def reset(self) -> None:
        """Forget all counts (tests reset between the phases they measure)."""
        self._entries.clear()

    def items(self) -> Iterator[tuple[LedgerKey, LedgerEntry]]:
        """All keys with their counters, in insertion order."""
        return iter(list(self._entries.items()))

    def total(self, collective: str | None = None, group: str | None = None, phase: str | None = None) -> LedgerEntry:
        """Sum of the entries matching every given filter (``None`` matches anything)."""
        out = LedgerEntry()
        for key, entry in self._entries.items():
            if collective is not None and key.collective != collective:
                continue
            if group is not None and key.group != group:
                continue
            if phase is not None and key.phase != phase:
                continue
            out.calls += entry.calls
            out.bytes += entry.bytes
            out.wire_bytes += entry.wire_bytes
        return out

    def copy(self) -> Ledger:
        """An independent copy (a mark to measure a window with :meth:`since`)."""
        out = Ledger()
        out._entries = {k: dataclasses.replace(v) for k, v in self._entries.items()}
        return out

    def since(self, mark: Ledger) -> Ledger:
        """What was recorded after ``mark`` (a :meth:`copy` taken earlier), without resetting anything."""
        out = Ledger()
        for key, entry in self._entries.items():
            old = mark._entries.get(key, LedgerEntry())
            delta = LedgerEntry(entry.calls - old.calls, entry.bytes - old.bytes, entry.wire_bytes - old.wire_bytes)
            if delta.calls:
                out._entries[key] = delta
        return out

    def snapshot(self) -> list[dict[str, object]]:
        """A picklable, JSON-friendly copy: one dict per key."""
        return [{**dataclasses.asdict(k), **dataclasses.asdict(v)} for k, v in self._entries.items()]

    def table(self) -> str:
        """A Markdown table of the ledger, for logs and benchmarks."""
        lines = ["| collective | group | phase | calls | bytes | wire bytes |", "|---|---|---|---:|---:|---:|"]
        for k, v in sorted(self._entries.items(), key=lambda kv: (kv[0].phase, kv[0].collective, kv[0].group)):
            lines.append(f"| {k.collective} | {k.group} | {k.phase} | {v.calls} | {v.bytes} | {v.wire_bytes} |")
        return "\n".join(lines)

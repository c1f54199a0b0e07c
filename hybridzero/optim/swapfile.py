"""Flat tensors in one swap file: fixed regions per key, positional reads and writes, reads ahead on I/O threads.

ZeRO-Infinity keeps each gather group's fp32 master shard (``master.bin``) and, with ``offload_param: nvme``, its
compute shard (``params.bin``) in files of the run's private :class:`~hybridzero.optim.swapdir.SwapDir`. A
:class:`TensorFile` is one such file; it implements :class:`hybridzero.zero.offload.ShardFile`, so a group reads and
writes its shard without knowing about files.

Invariants:
* One dtype per file; each key owns one fixed region (``numel`` elements), allocated at its first write (the whole
  tensor) and never moved, inside the bytes reserved at start-up: a write never grows the file past what
  ``posix_fallocate`` reserved, so a step never meets a full disk.
* Reading is a hint-free function of the file: :meth:`prefetch` only starts a read early on a background thread;
  :meth:`write` first waits for (and drops) any read of that key in flight, so a read never returns stale or torn
  bytes. Plain ``os.preadv`` / ``os.pwritev`` (no compiled extension); byte counters are thread-safe.
* :class:`ReadAhead` learns which key followed which in the last pass (forward order, then backward order) and reads
  ahead along it -- at most ``buffer_count`` buffers (the one in use included) and ``max_in_cpu`` elements ahead.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from hybridzero.optim.swapdir import SwapDir

__all__ = ["ReadAhead", "TensorFile"]


@dataclass(frozen=True)
class _Region:
    offset: int  # bytes
    numel: int


def _bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor (any dtype, bf16 included), writable when ``t`` is."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy().data)


class TensorFile:
    """Tensors of one dtype in ``name`` inside ``swap_dir``, ``reserve`` bytes allocated up front."""

    def __init__(
        self, swap_dir: SwapDir, name: str, dtype: torch.dtype, reserve: int, io: ThreadPoolExecutor, pin: bool = False
    ) -> None:
        self.path = swap_dir.path / name
        self.fd = swap_dir.open_file(name, reserve)
        self.dtype = dtype
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.reserved = reserve
        self.pin = pin and torch.cuda.is_available()  # read buffers pinned: H2D copies can then be asynchronous
        self._io = io
        self._regions: dict[int, _Region] = {}
        self._end = 0
        self._pending: dict[int, Future[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.bytes_written = 0

    # --- regions ---------------------------------------------------------------------------------------------------
    def numel(self, key: int) -> int:
        """Elements of ``key``'s region (KeyError if it was never written)."""
        return self._regions[key].numel

    def file_bytes(self) -> int:
        """Bytes of allocated regions (what the file holds)."""
        return self._end

    def _region(self, key: int, numel: int) -> _Region:
        region = self._regions.get(key)
        if region is None:
            region = _Region(self._end, numel)
            if self._end + numel * self.itemsize > self.reserved:
                raise OSError(
                    f"{self.path}: region of {numel * self.itemsize} bytes for key {key} exceeds the "
                    f"{self.reserved} bytes reserved at start-up"
                )
            self._regions[key] = region
            self._end += numel * self.itemsize
        return region

    # --- I/O -------------------------------------------------------------------------------------------------------
    def _read(self, key: int, lo: int, hi: int) -> torch.Tensor:
        region = self._regions[key]
        out = torch.empty(hi - lo, dtype=self.dtype, pin_memory=self.pin)
        want = (hi - lo) * self.itemsize
        done = os.preadv(self.fd, [_bytes(out)], region.offset + lo * self.itemsize) if want else 0
        if done != want:
            raise OSError(f"short read from {self.path}: {done} of {want} bytes")
        with self._lock:
            self.bytes_read += done
        return out

    def read(self, key: int, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Elements ``[lo, hi)`` of ``key`` (default: all) as a new CPU tensor; a whole read started by
        :meth:`prefetch` is taken over instead of read again."""
        region = self._regions[key]
        hi = region.numel if hi is None else hi
        if not 0 <= lo <= hi <= region.numel:
            raise IndexError(f"{self.path}: range [{lo}, {hi}) outside key {key}'s {region.numel} elements")
        pending = self._pending.pop(key, None)
        if pending is not None and (lo, hi) == (0, region.numel):
            return pending.result()
        if pending is not None:
            pending.result()
        return self._read(key, lo, hi)

    def prefetch(self, key: int) -> None:
        """Start reading the whole of ``key`` on an I/O thread (a hint: :meth:`read` returns the same bytes)."""
        if key in self._regions and key not in self._pending:
            self._pending[key] = self._io.submit(self._read, key, 0, self._regions[key].numel)

    def prefetched(self) -> tuple[int, int]:
        """Reads in flight or done but not yet taken: how many, and their elements."""
        return len(self._pending), sum(self._regions[k].numel for k in self._pending)

    def write(self, key: int, t: torch.Tensor, lo: int = 0) -> None:
        """Write ``t`` (cast to the file's dtype) at element ``lo`` of ``key``; the first write of a key allocates
        its region with ``t``'s size (``lo`` must then be 0). A read of ``key`` in flight is completed and dropped."""
        flat = t.detach().reshape(-1).to(device="cpu", dtype=self.dtype).contiguous()
        if key not in self._regions and lo != 0:
            raise KeyError(f"{self.path}: key {key} has no region yet; its first write must cover it whole")
        region = self._region(key, flat.numel())
        if lo < 0 or lo + flat.numel() > region.numel:
            raise IndexError(f"{self.path}: write of {flat.numel()} elements at {lo} outside key {key}")
        pending = self._pending.pop(key, None)
        if pending is not None:
            pending.result()
        want = flat.numel() * self.itemsize
        done = os.pwritev(self.fd, [_bytes(flat)], region.offset + lo * self.itemsize) if want else 0
        if done != want:
            raise OSError(f"short write to {self.path}: {done} of {want} bytes")
        with self._lock:
            self.bytes_written += done

    def drain(self) -> None:
        """Complete and drop every read in flight."""
        for pending in self._pending.values():
            pending.result()
        self._pending.clear()


class ReadAhead:
    """A :class:`TensorFile` of compute shards read ahead along the order of the previous reads (see module
    docstring). Implements :class:`hybridzero.zero.offload.ShardFile`.

    The order is learned as "after ``a`` then ``b`` came ``c``" (pairs, so a forward and the backward after it,
    which pass the same key in opposite directions, are told apart); a wrong guess only costs a read."""

    def __init__(self, file: TensorFile, buffer_count: int, max_in_cpu: int) -> None:
        self.file = file
        self.buffer_count = max(1, buffer_count)
        self.max_in_cpu = max_in_cpu
        self._next: dict[tuple[int, int], int] = {}  # (key before, key) -> the key read after them last time
        self._recent: tuple[int, int] = (-1, -1)  # the last two distinct keys read

    def read(self, key: int, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """``key``'s elements (as :meth:`TensorFile.read`); learns the order and starts the next reads."""
        out = self.file.read(key, lo, hi)
        before, last = self._recent
        if key != last:
            if last >= 0 and before >= 0:
                self._next[(before, last)] = key
            self._recent = (last, key)
        self._read_ahead(*self._recent)
        return out

    def _read_ahead(self, before: int, key: int) -> None:
        seen = {key}
        nxt = self._next.get((before, key))
        while nxt is not None and nxt not in seen:
            count, numel = self.file.prefetched()
            if count + 1 >= self.buffer_count or numel + self.file.numel(nxt) > self.max_in_cpu:
                return
            self.file.prefetch(nxt)
            seen.add(nxt)
            before, key, nxt = key, nxt, self._next.get((key, nxt))

    def write(self, key: int, t: torch.Tensor, lo: int = 0) -> None:
        """Write through to the file (drops a read of ``key`` in flight)."""
        self.file.write(key, t, lo)

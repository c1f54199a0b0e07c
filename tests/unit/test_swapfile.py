"""Tensors in swap files without a process group: fixed regions, exact round trips in every dtype, reads ahead that
are only hints (a write drops them, a read returns the file's bytes), the read-ahead bounds (``buffer_count``,
``max_in_cpu``), start-up space checks naming the path and the bytes, and a group's master moved into a file and back
bit for bit."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from hybridzero.optim.swapdir import SwapDir, SwapSpaceError, check_space
from hybridzero.optim.swapfile import ReadAhead, TensorFile
from hybridzero.zero.offload import CopyStream, Placement


@pytest.fixture
def io() -> Iterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(max_workers=2)
    yield pool
    pool.shutdown(wait=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_regions_round_trip_bitwise_and_count_bytes(tmp_path: Path, io: ThreadPoolExecutor, dtype: torch.dtype) -> None:
    d = SwapDir(tmp_path, 0)
    item = torch.empty((), dtype=dtype).element_size()
    f = TensorFile(d, "t.bin", dtype, (37 + 101) * item, io)
    a, b = torch.randn(37).to(dtype), torch.randn(101).to(dtype)
    f.write(3, a)
    f.write(7, b)
    assert f.file_bytes() == (37 + 101) * item and f.numel(7) == 101
    assert torch.equal(f.read(3), a) and torch.equal(f.read(7, 10, 50), b[10:50])
    piece = torch.randn(11).to(dtype)
    f.write(7, piece, 90)  # a partial write lands in place; the rest of the region is untouched
    assert torch.equal(f.read(7), torch.cat([b[:90], piece]))
    assert f.bytes_written == (37 + 101 + 11) * item and f.bytes_read == (37 + 40 + 101) * item
    with pytest.raises(IndexError, match="outside key 7"):
        f.write(7, piece, 95)
    with pytest.raises(KeyError, match="first write must cover it whole"):
        f.write(9, piece, 4)
    with pytest.raises(OSError, match="exceeds the .* bytes reserved"):
        f.write(9, torch.zeros(1, dtype=dtype))
    d.close()


def test_prefetch_is_a_hint_a_write_drops_it(tmp_path: Path, io: ThreadPoolExecutor) -> None:
    d = SwapDir(tmp_path, 0)
    f = TensorFile(d, "t.bin", torch.float32, 4 * 64, io)
    f.write(0, torch.arange(64.0))
    f.prefetch(0)
    assert f.prefetched() == (1, 64)
    f.write(0, torch.full((8,), -1.0), 8)  # lands after the read ahead started: the read must see it
    assert torch.equal(f.read(0)[6:18], torch.tensor([6.0, 7.0] + [-1.0] * 8 + [16.0, 17.0]))
    f.prefetch(0)
    assert torch.equal(f.read(0, 0, 4), torch.arange(4.0)) and f.prefetched() == (0, 0)  # a partial read too
    d.close()


def test_read_ahead_is_bounded_by_buffer_count_and_max_in_cpu(tmp_path: Path, io: ThreadPoolExecutor) -> None:
    """``offload_param.buffer_count`` shards in memory at most (the one in use and the ones read ahead), holding
    at most ``max_in_cpu`` elements ahead; the order is learned from the previous pass; results never change."""
    d = SwapDir(tmp_path, 0)
    sizes = [5, 7, 9, 11, 13]
    f = TensorFile(d, "p.bin", torch.float32, 4 * sum(sizes), io)
    values = {k: torch.randn(n) for k, n in enumerate(sizes)}
    for k, v in values.items():
        f.write(k, v)
    order = [0, 1, 2, 3, 4, 4, 3, 2, 1, 0]  # a forward, then a backward

    def ahead_after_each(reader: ReadAhead) -> list[tuple[int, int]]:
        seen = []
        for k in order:
            assert torch.equal(reader.read(k), values[k])
            seen.append(f.prefetched())
        f.drain()
        return seen

    first = ahead_after_each(ReadAhead(f, buffer_count=3, max_in_cpu=10**9))
    assert first[:4] == [(0, 0)] * 4  # nothing learned yet on the first forward
    learned = ReadAhead(f, buffer_count=3, max_in_cpu=10**9)
    ahead_after_each(learned)
    ahead_after_each(learned)
    # steady state: two shards ahead (buffer_count 3 = the one in use + 2) along forward, then backward order
    steady = [(2, 16), (2, 20), (2, 24), (1, 13), (2, 20), (2, 20), (2, 16), (2, 12), (1, 5), (2, 16)]
    assert ahead_after_each(learned) == steady
    tight = ReadAhead(f, buffer_count=3, max_in_cpu=10)  # elements ahead capped: only small shards fit
    ahead_after_each(tight)
    ahead_after_each(tight)
    assert ahead_after_each(tight) == [(1, 7), (1, 9), (0, 0), (0, 0), (0, 0), (0, 0), (1, 9), (1, 7), (1, 5), (1, 7)]
    one = ReadAhead(f, buffer_count=1, max_in_cpu=10**9)  # one buffer: the one in use, nothing ahead
    ahead_after_each(one)
    assert ahead_after_each(one) == [(0, 0)] * len(order)
    d.close()


def test_space_check_names_path_and_bytes(tmp_path: Path) -> None:
    d = SwapDir(tmp_path, 0, "offload_param")
    with pytest.raises(
        SwapSpaceError, match=r"offload_param.nvme_path: 1267650600228229401496703205376 bytes are needed"
    ):
        check_space(d, 2**100, "compute shards")
    assert d.closed  # nothing left behind by a refused start


def test_unwritable_param_path_names_offload_param(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(SwapSpaceError, match=r"offload_param.nvme_path = .* is not a writable directory"):
        SwapDir(blocker / "swap", 0, "offload_param")


def test_copy_stream_is_a_plain_move_without_cuda() -> None:
    """The side-stream H2D path only exists with CUDA; on a CPU device it is :func:`move` (same tensor or a cast)."""
    copies = CopyStream(torch.device("cpu"))
    t = torch.randn(9)
    assert copies.stream is None and copies.to_device(t, torch.float32) is t
    assert torch.equal(copies.to_device(t, torch.bfloat16), t.to(torch.bfloat16))
    placement = Placement.build(torch.device("cpu"), "nvme", "nvme", pin_memory=True)
    assert (placement.copies is None) == (not torch.cuda.is_available())  # no CUDA: nothing pinned, no stream

"""The NVMe swap machinery without a process group: the private, locked swap directory (stale ones from killed runs
removed, never read; live ones left alone), start-up errors for unusable paths and full disks, the chunking, and a
chunk-streamed optimizer step that is bitwise the plain step."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from hybridzero.optim.swap import StateSwapper, chunk_leaves, state_tensors_per_element
from hybridzero.optim.swapdir import LOCK_SUFFIX, SWAP_ROOT, SwapDir, SwapSpaceError

_REPO = Path(__file__).resolve().parents[2]


def test_swap_dir_is_private_locked_and_removed_on_close(tmp_path: Path) -> None:
    a, b = SwapDir(tmp_path, 0), SwapDir(tmp_path, 0)
    assert a.path != b.path and a.path.parent == b.path.parent == tmp_path / SWAP_ROOT
    lock = a.path.with_name(a.path.name + LOCK_SUFFIX)
    info = json.loads(lock.read_text())
    assert info["pid"] == os.getpid() and info["rank"] == 0
    fd = a.open_file("state.bin", 4096)
    assert os.fstat(fd).st_size == 4096
    c = SwapDir(tmp_path, 1)  # a third dir's start-up scan leaves the two live ones alone
    assert a.path.exists() and b.path.exists()
    for d in (a, b, c):
        d.close()
        d.close()  # idempotent
        assert d.closed and not d.path.exists()
    assert not lock.exists() and list((tmp_path / SWAP_ROOT).iterdir()) == []


def test_file_names_cannot_escape_the_directory(tmp_path: Path) -> None:
    d = SwapDir(tmp_path, 0)
    for bad in ("../x", "sub/x", ".."):
        with pytest.raises(ValueError, match="plain file name"):
            d.open_file(bad, 0)
    d.close()


def test_stale_directory_of_a_killed_run_is_removed_not_read(tmp_path: Path) -> None:
    code = (
        "import sys, time; from hybridzero.optim.swapdir import SwapDir; d = SwapDir(sys.argv[1], 0); "
        "d.open_file('optimizer_state.bin', 1 << 16); print(d.path, flush=True); time.sleep(60)"
    )
    env = {**os.environ, "PYTHONPATH": str(_REPO)}
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    stale = Path(proc.stdout.readline().strip())
    assert stale.is_dir()
    live = SwapDir(tmp_path, 0)  # the owner is alive: its directory stays
    assert stale.is_dir()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert stale.is_dir()  # a kill leaves the directory behind...
    fresh = SwapDir(tmp_path, 0)  # ...and the next start-up removes it without reading it
    assert not stale.exists() and live.path.exists() and fresh.path.exists()
    legacy = tmp_path / SWAP_ROOT / "no-lock-rank0"  # a directory without a lock file has no owner either
    legacy.mkdir()
    SwapDir(tmp_path, 0).close()
    assert not legacy.exists()
    live.close()
    fresh.close()


def test_unwritable_nvme_path_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(SwapSpaceError, match=r"nvme_path = '.*a_file/x' is not a writable directory"):
        SwapDir(blocker / "x", 0)


def test_full_disk_is_a_start_up_error_naming_the_bytes(tmp_path: Path) -> None:
    d = SwapDir(tmp_path, 0)
    need = shutil.disk_usage(tmp_path).free + (1 << 40)
    with pytest.raises(SwapSpaceError, match=rf"{need} bytes are needed .* but only \d+ are free"):
        d.open_file("optimizer_state.bin", need)
    assert d.closed and not d.path.exists()


def test_chunks_hold_whole_leaves_up_to_sub_group_size() -> None:
    leaves = [nn.Parameter(torch.zeros(n)) for n in (3, 4, 10, 2, 2, 1)]
    sizes = [[p.numel() for p in c] for c in chunk_leaves(leaves, 7)]
    assert sizes == [[3, 4], [10], [2, 2, 1]]
    assert [[p.numel() for p in c] for c in chunk_leaves(leaves, 1)] == [[3], [4], [10], [2], [2], [1]]


def _leaves(seed: int) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(n, generator=g)) for n in (37, 5, 101, 13)]


@pytest.mark.parametrize(
    ("make", "per_element"),
    [
        (lambda ps: torch.optim.AdamW([{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0}], lr=0.1), 2),
        (lambda ps: torch.optim.Adam(ps, lr=0.1, amsgrad=True), 3),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 1),
    ],
)
def test_streamed_step_is_bitwise_the_plain_step(tmp_path: Path, make, per_element: int) -> None:
    plain, swapped = _leaves(0), _leaves(0)
    opt_plain, opt_swapped = make(plain), make(swapped)
    assert state_tensors_per_element(opt_swapped) == per_element
    swapper = StateSwapper(opt_swapped, str(tmp_path), 0, sub_group_size=50, buffer_count=2)
    assert len(swapper.chunks) == 3 and swapper.reserved == 4 * per_element * 156
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        for a, b in zip(plain, swapped):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        opt_plain.step()
        swapper.step()
        assert not opt_swapped.state  # between steps everything is in the file
    assert all(torch.equal(a, b) for a, b in zip(plain, swapped))
    assert swapper.file_bytes() == swapper.reserved == os.path.getsize(swapper.dir.path / "optimizer_state.bin")
    with swapper.resident():
        for a, b in zip(plain, swapped):
            for key, value in opt_plain.state[a].items():
                assert torch.equal(value, opt_swapped.state[b][key]), key
    assert swapper.bytes_read == 2 * swapper.reserved + swapper.reserved  # steps 2 and 3, and resident()
    swapper.close()
    assert not swapper.dir.path.exists()

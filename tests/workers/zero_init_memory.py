"""Per-rank body of the ``zero.Init`` memory test: building a block-dominated Llama inside ``zero.Init`` never holds
the whole model on a rank (the RSS high-water mark and live tensor bytes, measured around construction). Apart from
:mod:`tests.workers.zero_init` because it is the one worker that tunes the allocator and reads ``/proc``."""

from __future__ import annotations

import ctypes
from typing import Any

from tests.harness.models import block_dominated_llama
from tests.workers.construction import live_tensor_bytes


def _allocations_return_to_os() -> None:
    """glibc: serve every allocation of 32 KiB or more with its own mmap (also the per-rank shards of 1M-element
    parameters, just under 1 MiB at world 4), so freed temporaries leave the process at once and the RSS high-water
    mark measures live memory rather than heap the allocator keeps."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 32 << 10)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 32 << 10)  # M_TRIM_THRESHOLD


def _reset_peak_rss() -> int:
    """Reset this process's RSS high-water mark (Linux: ``clear_refs`` 5) and return the resident bytes now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_bytes("VmRSS")


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def init_peak_memory(layers: int) -> dict[str, Any]:
    """Build ``block_dominated_llama(layers)`` under ``zero.Init``; report the growth of the process's RSS high-water
    mark (reset just before) during construction, the live tensor bytes after it, and the model's sizes."""
    import hybridzero

    _allocations_return_to_os()
    hybridzero.init_distributed()
    block_dominated_llama(1)  # import and warm up the model classes outside the measurement
    live0 = live_tensor_bytes()
    rss0 = _reset_peak_rss()
    with hybridzero.zero.Init() as init:
        model = block_dominated_llama(layers)
    rss_growth = _status_bytes("VmHWM") - rss0
    assert init.store is not None
    sizes = [p.ds_numel for p in model.parameters()]
    return {
        "numel": sum(sizes),
        "largest": max(sizes),
        "rss_growth": rss_growth,
        "live_growth": live_tensor_bytes() - live0,
        "held": init.store.held_bytes(),
        "open_after": len(init.store.open_params()),
    }

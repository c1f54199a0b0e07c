"""``deepspeed.accelerator``: :func:`get_accelerator` and an accelerator object with DeepSpeed's method names.

DeepSpeed user code (DeepSpeed-Chat, Hugging Face's integration) asks ``get_accelerator()`` for the device's name,
RNG, memory counters and communication backend instead of calling ``torch.cuda`` directly. hybridzero runs on CPU
(gloo) and CUDA (NCCL); :class:`Accelerator` answers DeepSpeed's names for either by delegating to torch.

Which one: ``DS_ACCELERATOR`` (DeepSpeed's variable: ``cpu`` or ``cuda``; any other value is an error naming it)
if set, else ``cuda`` when ``torch.cuda.is_available()``, else ``cpu`` — DeepSpeed's detection order for these two.

State: an :class:`Accelerator` is a frozen value (its device type); everything it reports is read from torch or
the operating system at call time, so ``get_accelerator()`` may build a fresh one per call and there is no module
global to set or reset. DeepSpeed's ``set_accelerator`` (a process-wide override) is therefore not provided; set
``DS_ACCELERATOR`` before the first call instead. The one unavoidable process state is torch's own (RNG, current
CUDA device), which the methods change exactly as DeepSpeed's do.

CPU semantics as DeepSpeed's CPU accelerator: ``device_name()`` is ``"cpu"`` whatever the index; ``set_device`` and
``synchronize`` do nothing; memory counters are the process's resident set size (``max_memory_allocated``: its peak
as the kernel tracks it, which cannot be reset, so ``reset_max_memory_allocated`` does nothing); ``pin_memory``
returns its argument; bf16 is supported, fp16 where oneDNN has native fp16 kernels for the processor. The CPU
backend is ``gloo`` (DeepSpeed says ``ccl`` when Intel's oneCCL bindings are installed; hybridzero runs on gloo).
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

__all__ = ["Accelerator", "get_accelerator"]

_KINDS = ("cpu", "cuda")


def _rss_bytes() -> int:
    """Current resident set size of this process (Linux ``/proc``; elsewhere the peak, the best available)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return _peak_rss_bytes()  # no /proc: the peak is the closest reading


def _peak_rss_bytes() -> int:
    """Peak resident set size (``ru_maxrss`` is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _max_rss_bytes() -> int:
    """Peak resident set size, never below the current one (the kernel updates ``ru_maxrss`` lazily)."""
    return max(_peak_rss_bytes(), _rss_bytes())


def _host_memory(name: str) -> int:
    """``SC_PHYS_PAGES`` (total) or ``SC_AVPHYS_PAGES`` (available) in bytes; 0 where the OS does not say."""
    try:
        return int(os.sysconf(name) * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError):
        return 0


@dataclass(frozen=True)
class Accelerator:
    """DeepSpeed's accelerator interface for one device type (``"cpu"`` or ``"cuda"``); see the module docstring."""

    kind: str

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"accelerator {self.kind!r} is not supported; valid: {', '.join(_KINDS)}")

    @property
    def _name(self) -> str:
        """DeepSpeed's attribute spelling of the device name (read by some user code)."""
        return self.kind

    @property
    def _cuda(self) -> bool:
        return self.kind == "cuda"

    # --- devices ----------------------------------------------------------------------------------------------------
    def is_available(self) -> bool:
        """Whether the device type is usable in this process."""
        return torch.cuda.is_available() if self._cuda else True

    def is_synchronized_device(self) -> bool:
        """True on CPU: work is done when the call returns (DeepSpeed skips stream logic then)."""
        return not self._cuda

    def use_host_timers(self) -> bool:
        """Timers read the host clock on synchronized devices."""
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        """Synchronized devices need no explicit data-dependency resolution."""
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        """Synchronized devices need no memory back-pressure handling."""
        return self.is_synchronized_device()

    def device_name(self, device_index: int | None = None) -> str:
        """``"cuda"`` / ``"cuda:N"`` with an index; ``"cpu"`` always (DeepSpeed's CPU accelerator ignores it)."""
        if self._cuda and device_index is not None:
            return f"cuda:{device_index}"
        return self.kind

    def device(self, device_index: int | None = None) -> Any:
        """``torch.cuda.device(index)`` (a context manager) on CUDA; ``None`` on CPU, as DeepSpeed's."""
        return torch.cuda.device(device_index) if self._cuda else None

    def set_device(self, device_index: int) -> None:
        """Make ``device_index`` the current CUDA device; nothing on CPU."""
        if self._cuda:
            torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        """The current CUDA device index; on CPU the launcher's ``LOCAL_RANK`` (0 without one)."""
        return torch.cuda.current_device() if self._cuda else int(os.environ.get("LOCAL_RANK", "0"))

    def current_device_name(self) -> str:
        """``"cuda:N"`` for the current CUDA device; ``"cpu"``."""
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device_count(self) -> int:
        """CUDA devices; on CPU the launcher's ``LOCAL_WORLD_SIZE`` (DeepSpeed: ``LOCAL_SIZE``), else 1."""
        if self._cuda:
            return torch.cuda.device_count()
        return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))

    def synchronize(self, device_index: int | None = None) -> None:
        """Wait for the device's queued work (CUDA); nothing on CPU."""
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on this device type."""
        return tensor.device.type == self.kind

    # --- RNG ----------------------------------------------------------------------------------------------------------
    def random(self) -> ModuleType:
        """The RNG module (``torch.random``; ``torch.cuda.random`` on CUDA)."""
        return torch.cuda.random if self._cuda else torch.random

    def manual_seed(self, seed: int) -> Any:
        """Seed the device's generator (CPU: torch's global generator)."""
        return torch.cuda.manual_seed(seed) if self._cuda else torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> Any:
        """Seed every device's generator (CPU: torch's global generator)."""
        return torch.cuda.manual_seed_all(seed) if self._cuda else torch.manual_seed(seed)

    def initial_seed(self) -> int:
        """The seed the device's generator started from."""
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        """The generator's state."""
        if self._cuda:
            return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        """Restore the generator's state."""
        if self._cuda:
            torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)
        else:
            torch.set_rng_state(new_state)

    def default_generator(self, device_index: int) -> torch.Generator:
        """The device's default generator."""
        return torch.cuda.default_generators[device_index] if self._cuda else torch.default_generator

    # --- streams and events -------------------------------------------------------------------------------------------
    @property
    def Stream(self) -> Any:  # noqa: N802 - DeepSpeed's name
        """``torch.cuda.Stream``; ``None`` on CPU."""
        return torch.cuda.Stream if self._cuda else None

    @property
    def Event(self) -> Any:  # noqa: N802 - DeepSpeed's name
        """``torch.cuda.Event``; ``None`` on CPU."""
        return torch.cuda.Event if self._cuda else None

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """``torch.cuda.stream(stream)``; a no-op context on CPU."""
        return torch.cuda.stream(stream) if self._cuda else contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> Any:
        """The current CUDA stream; ``None`` on CPU."""
        return torch.cuda.current_stream(device_index) if self._cuda else None

    def default_stream(self, device_index: int | None = None) -> Any:
        """The default CUDA stream; ``None`` on CPU."""
        return torch.cuda.default_stream(device_index) if self._cuda else None

    # --- memory -------------------------------------------------------------------------------------------------------
    def empty_cache(self) -> None:
        """Return cached CUDA blocks to the driver; nothing on CPU."""
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        """Bytes held by tensors (CUDA); the resident set size on CPU."""
        return torch.cuda.memory_allocated(device_index) if self._cuda else _rss_bytes()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """Peak of :meth:`memory_allocated`."""
        return torch.cuda.max_memory_allocated(device_index) if self._cuda else _max_rss_bytes()

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        """Reset the CUDA peak; nothing on CPU (the kernel's peak cannot be reset)."""
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        """Bytes the CUDA caching allocator holds; the resident set size on CPU."""
        return torch.cuda.memory_reserved(device_index) if self._cuda else _rss_bytes()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        """Peak of :meth:`memory_reserved`."""
        return torch.cuda.max_memory_reserved(device_index) if self._cuda else _max_rss_bytes()

    memory_cached = memory_reserved
    max_memory_cached = max_memory_reserved
    reset_max_memory_cached = reset_max_memory_allocated
    reset_peak_memory_stats = reset_max_memory_allocated

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        """``torch.cuda.memory_stats``; on CPU the two keys DeepSpeed's CPU accelerator reports."""
        if self._cuda:
            return dict(torch.cuda.memory_stats(device_index))
        return {"allocated_bytes.all.current": _rss_bytes(), "allocated_bytes.all.peak": _max_rss_bytes()}

    def total_memory(self, device_index: int | None = None) -> int:
        """The device's memory in bytes (host memory on CPU)."""
        if self._cuda:
            return int(torch.cuda.get_device_properties(device_index or 0).total_memory)
        return _host_memory("SC_PHYS_PAGES")

    def available_memory(self, device_index: int | None = None) -> int:
        """Free device memory in bytes (available host memory on CPU)."""
        if self._cuda:
            return int(torch.cuda.mem_get_info(device_index)[0])
        return _host_memory("SC_AVPHYS_PAGES")

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """A page-locked copy for fast host-to-CUDA copies; the tensor itself on CPU."""
        return tensor.pin_memory() if self._cuda else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is page-locked."""
        return bool(tensor.is_pinned()) if self._cuda else False

    # --- data types and misc --------------------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        """bf16 compute: always on CPU; the device's answer on CUDA."""
        return bool(torch.cuda.is_bf16_supported()) if self._cuda else True

    def is_fp16_supported(self) -> bool:
        """fp16 compute: always on CUDA; on CPU whether oneDNN has native fp16 kernels for this processor, the
        answer DeepSpeed's CPU accelerator gives (so tests and recipes that pick a dtype by it pick the same)."""
        return True if self._cuda else _cpu_has_native_fp16()

    def supported_dtypes(self) -> list[torch.dtype]:
        """Compute dtypes DeepSpeed may pick on this device."""
        dtypes = [torch.float32]
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        return dtypes

    def communication_backend_name(self) -> str:
        """``"nccl"`` on CUDA, ``"gloo"`` on CPU (the backends ``init_distributed`` uses)."""
        return "nccl" if self._cuda else "gloo"

    def amp(self) -> ModuleType:
        """The autocast module (``torch.cuda.amp`` / ``torch.cpu.amp``)."""
        return torch.cuda.amp if self._cuda else torch.cpu.amp

    def is_triton_supported(self) -> bool:
        """Whether Triton kernels could run (CUDA with compute capability 8 or more)."""
        return self._cuda and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8

    def range_push(self, msg: str) -> None:
        """Open an NVTX range on CUDA; nothing on CPU."""
        if self._cuda:
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        """Close the innermost NVTX range on CUDA; nothing on CPU."""
        if self._cuda:
            torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        """Run ``callback`` when the device is initialized (now on CPU)."""
        if self._cuda:
            return torch.cuda._lazy_call(callback)  # DeepSpeed's CUDA accelerator calls the same
        return callback()

    def visible_devices_envs(self) -> list[str]:
        """Environment variables that select visible devices."""
        return ["CUDA_VISIBLE_DEVICES"] if self._cuda else []

    def export_envs(self) -> list[str]:
        """Environment variable prefixes a multi-node launcher forwards."""
        return ["NCCL"] if self._cuda else []

    def create_op_builder(self, op_name: str) -> Any:
        """DeepSpeed's compiled-op builders do not exist here: refused by name."""
        raise NotImplementedError(
            f"get_accelerator().create_op_builder({op_name!r}): hybridzero has no compiled DeepSpeed ops; "
            "use hybridzero.ops.adam.FusedAdam / DeepSpeedCPUAdam (torch optimizers) instead"
        )

    get_op_builder = create_op_builder


def get_accelerator() -> Accelerator:
    """The accelerator of this process: ``DS_ACCELERATOR`` if set (``cpu``/``cuda``), else CUDA when available,
    else CPU. A fresh frozen value per call (see the module docstring: no global state)."""
    choice = os.environ.get("DS_ACCELERATOR")
    if choice is not None:
        if choice not in _KINDS:
            raise ValueError(f"DS_ACCELERATOR={choice!r} is not supported by hybridzero; valid: {', '.join(_KINDS)}")
        return Accelerator(choice)
    return Accelerator("cuda" if torch.cuda.is_available() else "cpu")


def _cpu_has_native_fp16() -> bool:
    """Whether this CPU has native fp16 kernels (oneDNN's probe; False where this torch build lacks it)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False

"""DeepSpeed's activation-checkpointing API (``deepspeed.checkpointing``), for Megatron-style model code.

``configure(mpu, deepspeed_config=..., ...)`` once, then ``checkpoint(block, *args)`` around a block: its activations
are dropped after the forward and recomputed in the backward, with the RNG state of the forward (dropout draws the
same mask), as torch's reentrant checkpoint does it. ``non_reentrant_checkpoint`` is torch's non-reentrant one. The
Megatron RNG tracker (``get_cuda_rng_tracker``, ``model_parallel_cuda_manual_seed``) keeps named generator states
for the device in use (CUDA when present, else the CPU generator), so model-parallel dropout code runs unchanged.

Settings, from the config's ``activation_checkpointing`` block or ``configure``'s arguments (arguments win):
``cpu_checkpointing`` keeps the checkpointed inputs in host memory until the backward
(``torch.autograd.graph.save_on_cpu``); ``synchronize_checkpoint_boundary`` synchronizes the device around each
checkpoint; ``profile`` logs each checkpointed forward's time (rank 0). ``partition_activations`` and
``contiguous_memory_optimization`` split saved inputs over model-parallel ranks in DeepSpeed: hybridzero trains
without model parallelism, so with no ``mpu`` (or one of model-parallel size 1) there is nothing to split and they
change nothing; an ``mpu`` of model-parallel size > 1 is refused, naming it. Unknown keys are refused, naming them.

DeepSpeed's API is process-wide by contract (``configure`` in the launcher, ``checkpoint`` in model files): the one
:class:`CheckpointingSettings` object below holds that state explicitly; ``reset``/``configure`` replace its fields.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

__all__ = [
    "CheckpointingSettings",
    "RNGStatesTracker",
    "SETTINGS",
    "checkpoint",
    "configure",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "model_parallel_reconfigure_tp_seed",
    "non_reentrant_checkpoint",
    "partition_activations_in_checkpoint",
    "reset",
    "set_num_layers",
]

_LOG = logging.getLogger("hybridzero")
MODEL_PARALLEL_RNG = "model-parallel-rng"
_TP_SEED_OFFSET = 2718  # Megatron's offset of the model-parallel seed, so seeds match runs made with DeepSpeed

_CONFIG_KEYS = {  # the config block's key -> the settings field
    "partition_activations": "partition_activations",
    "contiguous_memory_optimization": "contiguous_memory_optimization",
    "number_checkpoints": "number_checkpoints",
    "cpu_checkpointing": "cpu_checkpointing",
    "synchronize_checkpoint_boundary": "synchronize",
    "profile": "profile",
}


@dataclass
class CheckpointingSettings:
    """The process's activation-checkpointing settings (DeepSpeed's defaults until ``configure``)."""

    configured: bool = False
    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    cpu_checkpointing: bool = False
    synchronize: bool = False
    profile: bool = False
    num_layers: int | None = None


SETTINGS = CheckpointingSettings()


def _block_of(deepspeed_config: Any) -> dict[str, Any]:
    """The ``activation_checkpointing`` block of a config dict or JSON file (empty when absent)."""
    if deepspeed_config is None:
        return {}
    if isinstance(deepspeed_config, (str, os.PathLike)):
        with open(deepspeed_config, encoding="utf-8") as f:
            deepspeed_config = json.load(f)
    if not isinstance(deepspeed_config, dict):
        raise TypeError(f"deepspeed_config: a dict or a JSON file path, got {type(deepspeed_config).__name__}")
    block = deepspeed_config.get("activation_checkpointing", {})
    unknown = sorted(set(block) - set(_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"activation_checkpointing: unknown key(s) {unknown}; valid keys: {sorted(_CONFIG_KEYS)}")
    return {_CONFIG_KEYS[k]: v for k, v in block.items()}


def _model_parallel_size(mpu: Any) -> int:
    return 1 if mpu is None else int(mpu.get_model_parallel_world_size())


def configure(
    mpu_: Any,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """DeepSpeed's ``deepspeed.checkpointing.configure``: settings from ``deepspeed_config``'s
    ``activation_checkpointing`` block, then the arguments given (not ``None``) over them."""
    if _model_parallel_size(mpu_) > 1:
        raise ValueError(
            f"deepspeed.checkpointing.configure: mpu_ has model-parallel size {_model_parallel_size(mpu_)}; "
            "hybridzero trains without model parallelism (give mpu_=None or an mpu of model-parallel size 1)"
        )
    values = _block_of(deepspeed_config)
    given = {
        "partition_activations": partition_activations,
        "contiguous_memory_optimization": contiguous_checkpointing,
        "number_checkpoints": num_checkpoints,
        "cpu_checkpointing": checkpoint_in_cpu,
        "synchronize": synchronize,
        "profile": profile,
    }
    values.update({k: v for k, v in given.items() if v is not None})
    if values.get("contiguous_memory_optimization") and values.get("number_checkpoints") is None:
        raise ValueError("activation_checkpointing: contiguous_memory_optimization needs number_checkpoints")
    for f in fields(CheckpointingSettings):
        if f.name in values:
            setattr(SETTINGS, f.name, values[f.name])
    SETTINGS.configured = True


def is_configured() -> bool:
    """True once :func:`configure` was called (:func:`reset` keeps it, as DeepSpeed's does)."""
    return SETTINGS.configured


def reset() -> None:
    """DeepSpeed's per-iteration reset of its contiguous buffers: hybridzero keeps none, so nothing to free."""


def set_num_layers(nlayers: int) -> None:
    """Record the number of checkpointed layers (DeepSpeed sizes its contiguous buffers with it)."""
    SETTINGS.num_layers = int(nlayers)


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    """Set ``partition_activations`` (a no-op without model parallelism, see the module docstring)."""
    SETTINGS.partition_activations = bool(partition_activation)


def _synchronize() -> None:
    if SETTINGS.synchronize and torch.cuda.is_available():
        torch.cuda.synchronize()


@contextmanager
def _around_checkpoint(what: str) -> Iterator[None]:
    """The settings that act around one checkpointed call: boundary synchronization, host-memory inputs, timing."""
    _synchronize()
    start = time.perf_counter()
    with torch.autograd.graph.save_on_cpu() if SETTINGS.cpu_checkpointing else nullcontext():
        yield
    _synchronize()
    if SETTINGS.profile and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
        _LOG.info("%s forward: %.3f ms", what, 1000 * (time.perf_counter() - start))


def _replaying_tracker(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` whose recomputation (every call after the first) runs on the RNG tracker's states as they were
    at the first call, then puts the tracker back: dropout drawn in ``tracker.fork()`` replays its forward masks
    (torch's checkpoint replays only the default generator)."""
    at_forward: list[dict[str, torch.Tensor]] = []

    def run(*args: Any) -> Any:
        if not at_forward:
            at_forward.append(TRACKER.get_states())
            return function(*args)
        now = TRACKER.get_states()
        TRACKER.set_states(at_forward[0])
        try:
            return function(*args)
        finally:
            TRACKER.set_states(now)

    return run


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """DeepSpeed's reentrant ``checkpoint(function, *args, **kwargs)``: tensors passed by keyword take part in
    autograd as positional ones do; the forward's RNG states (default generator and tracker) are replayed in the
    recomputation. As DeepSpeed's, parameters inside get gradients only when an input requires grad."""
    if kwargs:
        keys, count, inner = tuple(kwargs), len(args), function

        def function(*all_args: Any) -> Any:
            return inner(*all_args[:count], **dict(zip(keys, all_args[count:])))

        args = args + tuple(kwargs.values())
    with _around_checkpoint("checkpoint"):
        return torch_checkpoint(_replaying_tracker(function), *args, use_reentrant=True, preserve_rng_state=True)


def non_reentrant_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """DeepSpeed's ``non_reentrant_checkpoint``: torch's non-reentrant checkpoint (outputs need no grad-requiring
    input; nested ``backward`` calls work), RNG states replayed as :func:`checkpoint` does."""
    with _around_checkpoint("non_reentrant_checkpoint"):
        return torch_checkpoint(_replaying_tracker(function), *args, use_reentrant=False, preserve_rng_state=True)


def _get_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state()


def _set_state(state: torch.Tensor) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _manual_seed(seed: int) -> None:
    """Seed the device generator (DeepSpeed's ``get_accelerator().manual_seed``)."""
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


class RNGStatesTracker:
    """Named generator states of the device in use (Megatron's ``CudaRNGStatesTracker``): ``add`` seeds one,
    ``fork`` runs a block on it and keeps where it got to; the default state is restored after either."""

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}
        self.seeds: set[int] = set()

    def reset(self) -> None:
        self.states, self.seeds = {}, set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """A new state ``name`` seeded with ``seed`` (each name and each seed once, as Megatron's)."""
        if seed in self.seeds:
            raise ValueError(f"RNG tracker: seed {seed} already exists")
        if name in self.states:
            raise ValueError(f"RNG tracker: state {name!r} already exists")
        before = _get_state()
        _manual_seed(seed)
        self.states[name] = _get_state()
        _set_state(before)
        self.seeds.add(seed)

    @contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the block on state ``name``; afterwards ``name`` continues from where the block left it."""
        if name not in self.states:
            raise KeyError(f"RNG tracker: no state {name!r} (add it first; known: {sorted(self.states)})")
        before = _get_state()
        _set_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_state()
            _set_state(before)


TRACKER = RNGStatesTracker()


def get_cuda_rng_tracker() -> RNGStatesTracker:
    """The process's RNG states tracker (DeepSpeed's name; CPU generator states on a host without CUDA)."""
    return TRACKER


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default generator with ``seed`` and the tracker's model-parallel state with ``seed + 2718`` (plus
    the tensor-parallel rank, 0 here), as Megatron and DeepSpeed do."""
    TRACKER.reset()
    _manual_seed(seed)
    TRACKER.add(MODEL_PARALLEL_RNG, seed + _TP_SEED_OFFSET)


def model_parallel_reconfigure_tp_seed(seed: int) -> None:
    """Re-seed the tracker's model-parallel state in place with ``seed + 2718`` (the default state untouched)."""
    with TRACKER.fork(MODEL_PARALLEL_RNG):
        _manual_seed(seed + _TP_SEED_OFFSET)
